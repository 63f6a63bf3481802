"""Where ``--model`` and ``--tokenizer`` come from, resolved as vLLM resolves them.

A directory that exists always wins. Anything else is a Hugging Face Hub repo id
(``namespace/name``): it is looked up in the local Hugging Face cache first (no network), then
downloaded into it (``snapshot_download``: safetensors weights, configs and tokenizer files only,
with progress bars) unless ``HF_HUB_OFFLINE`` is set. ``--revision``, ``--download-dir`` (the
cache directory) and ``HF_TOKEN`` are honoured; huggingface_hub reads its own environment
variables (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``, ``HF_ENDPOINT``).

Every way this can fail is a ``ModelSourceError`` whose message is one line naming what was
looked for, where, and what to do; ``python -m engine_svc`` prints it and exits 2.
"""

from __future__ import annotations

import codecs
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# What a download fetches (fnmatch patterns over the repo's paths; '*' crosses '/'): weights in
# safetensors (the only format we load), config / generation / tokenizer JSON, the chat
# template, sentencepiece and BPE vocabularies. Never *.bin, *.pt, *.gguf, *.onnx.
TOKENIZER_PATTERNS = ("*.json", "*.jinja", "*.model", "merges.txt", "vocab.txt")
MODEL_PATTERNS = ("*.safetensors", *TOKENIZER_PATTERNS)
# A tokenizer directory holds at least one of these (what transformers can load).
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json")

TRUST_REMOTE_CODE_REFUSAL = (
    "--trust-remote-code is not supported: Tandem runs its own model code (Llama, Qwen2 and "
    "Qwen3 families) and never executes code shipped with a checkpoint, so those models do not "
    "need the flag and it cannot enable any other architecture"
)


class ModelSourceError(OSError):
    """The model or tokenizer cannot be found or fetched; ``str()`` is one line saying why,
    where it was looked for and what to do."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved ``--model`` / ``--tokenizer``: the directory to load, and the Hub repo it came
    from (None for a local directory)."""

    path: Path
    repo_id: str | None = None


@dataclass(frozen=True)
class _Kind:
    noun: str  # "model" | "tokenizer"
    patterns: tuple[str, ...]
    missing: Callable[[Path], str | None]  # what a directory lacks, None when complete


def _model_missing(path: Path) -> str | None:
    if not (path / "config.json").is_file():
        return "config.json"
    if not (path / "model.safetensors.index.json").is_file() and not any(
        path.glob("*.safetensors")
    ):
        return "*.safetensors weights (Tandem loads safetensors checkpoints only)"
    return None


def _tokenizer_missing(path: Path) -> str | None:
    if any((path / f).is_file() for f in TOKENIZER_MARKERS):
        return None
    return f"tokenizer files ({', '.join(TOKENIZER_MARKERS)})"


MODEL = _Kind("model", MODEL_PATTERNS, _model_missing)
TOKENIZER = _Kind("tokenizer", TOKENIZER_PATTERNS, _tokenizer_missing)


def resolve_model(
    name: str | Path,
    *,
    revision: str | None = None,
    download_dir: str | Path | None = None,
    offline: bool | None = None,
) -> ModelSource:
    """The checkpoint directory for ``name``: a local directory, else a Hub repo id found in the
    Hugging Face cache (``download_dir``, default ``HF_HUB_CACHE``) or downloaded into it.
    ``offline`` None: huggingface_hub's ``HF_HUB_OFFLINE``. Raises ModelSourceError."""
    return _resolve(MODEL, name, revision, download_dir, offline)


def resolve_tokenizer(
    name: str | Path,
    *,
    revision: str | None = None,
    download_dir: str | Path | None = None,
    offline: bool | None = None,
) -> ModelSource:
    """The tokenizer directory for ``name``, resolved as ``resolve_model`` does (tokenizer
    files only: no weights are downloaded)."""
    return _resolve(TOKENIZER, name, revision, download_dir, offline)


def read_chat_template(value: str) -> str:
    """``--chat-template``: a file to read, else the Jinja template itself (vLLM's rule). A
    value with none of ``{``, ``}`` or a newline that is not a readable file is a path that
    failed: ValueError. An inline template has its backslash escapes decoded (``\\n`` typed in
    a shell becomes a newline), as vLLM does."""
    try:
        return Path(value).expanduser().read_text(encoding="utf-8")
    except (OSError, ValueError) as e:  # ValueError: a NUL byte, undecodable bytes
        if not any(c in value for c in "{}\n"):
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ValueError(
                f"--chat-template {value!r} looks like a file path but cannot be read "
                f"({reason}); pass a readable file or the Jinja template itself"
            ) from None
    # backslashreplace first, so that characters beyond latin-1 survive unicode_escape.
    return codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")


# ---------------------------------------------------------------------------------------------


def _resolve(
    kind: _Kind,
    name: str | Path,
    revision: str | None,
    download_dir: str | Path | None,
    offline: bool | None,
) -> ModelSource:
    local = Path(name).expanduser()
    if local.is_dir():  # a directory always wins over a repo id of the same spelling
        # Only what makes it a checkpoint at all: the loader then says, in its order, what is
        # wrong with one (an unsupported architecture before missing weights).
        if kind is MODEL:
            lacks = None if (local / "config.json").is_file() else "config.json"
        else:
            lacks = kind.missing(local)
        if lacks is not None:
            raise ModelSourceError(f"{kind.noun} directory {local} has no {lacks}")
        return ModelSource(local)
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo_id = str(name)
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ModelSourceError(
            f"{kind.noun} {repo_id!r} is neither an existing directory nor a Hugging Face Hub "
            "repo id (namespace/name)"
        ) from None
    hub = _Hub(kind, repo_id, revision, download_dir)
    cached = hub.cached()
    if cached is not None and (lacks := kind.missing(cached)) is None:
        logger.info("%s from the Hugging Face cache: %s", hub.what, cached)
        return ModelSource(cached, repo_id)
    if offline is None:
        offline = bool(constants.HF_HUB_OFFLINE)
    if offline:
        state = "is not in" if cached is None else f"lacks {lacks} in"
        raise ModelSourceError(
            f"{hub.what} {state} the Hugging Face cache {hub.cache_dir} and HF_HUB_OFFLINE is "
            f"set: download it first ({hub.download_command()}), unset HF_HUB_OFFLINE, or pass "
            "a local directory"
        )
    path = hub.download()
    if (lacks := kind.missing(path)) is not None:
        raise ModelSourceError(f"{hub.what} on the Hugging Face Hub has no {lacks}")
    return ModelSource(path, repo_id)


class _Hub:
    """One repo id in the Hugging Face cache: look it up, download it, explain failures."""

    def __init__(
        self, kind: _Kind, repo_id: str, revision: str | None, download_dir: str | Path | None
    ) -> None:
        from huggingface_hub import constants

        self.kind = kind
        self.repo_id = repo_id
        self.revision = revision
        self.download_dir = None if download_dir is None else str(Path(download_dir).expanduser())
        self.cache_dir = self.download_dir or constants.HF_HUB_CACHE
        self.what = f"{kind.noun} {repo_id!r} (revision {revision or 'main'})"

    def _snapshot(self, local_files_only: bool) -> Path:
        import huggingface_hub

        path = huggingface_hub.snapshot_download(
            self.repo_id,
            revision=self.revision,
            cache_dir=self.download_dir,
            allow_patterns=list(self.kind.patterns),
            local_files_only=local_files_only,
        )
        return Path(str(path))

    def cached(self) -> Path | None:
        """The cached snapshot (possibly incomplete), or None; never touches the network."""
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return self._snapshot(local_files_only=True)
        except LocalEntryNotFoundError:  # IncompleteSnapshotError too
            return None

    def download_command(self) -> str:
        parts = ["hf download", self.repo_id]
        if self.revision:
            parts.append(f"--revision {self.revision}")
        if self.download_dir:
            parts.append(f"--cache-dir {self.download_dir}")
        return " ".join(parts)

    def download(self) -> Path:
        logger.warning(
            "downloading %s from the Hugging Face Hub into %s", self.what, self.cache_dir
        )
        try:
            return self._snapshot(local_files_only=False)
        except Exception as e:  # whatever the cause, one line and no traceback
            raise ModelSourceError(self.explain(e)) from None

    def explain(self, e: Exception) -> str:
        """One line for a failed download."""
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        url = f"https://huggingface.co/{self.repo_id}"
        if isinstance(e, GatedRepoError):  # before RepositoryNotFoundError: a subclass of it
            return (
                f"{self.what} is gated on the Hugging Face Hub: accept its terms at {url} and "
                "set HF_TOKEN to a token of that account"
            )
        if isinstance(e, RepositoryNotFoundError):
            return (
                f"{self.what} is not on the Hugging Face Hub, or is private and HF_TOKEN gives "
                "no access to it; and there is no local directory of that name"
            )
        if isinstance(e, RevisionNotFoundError):
            return f"{self.what}: the Hugging Face Hub has no such revision of {self.repo_id}"
        if isinstance(e, LocalEntryNotFoundError):  # the Hub could not be reached
            return (
                f"cannot reach the Hugging Face Hub to download {self.what}, and it is not in "
                f"the cache {self.cache_dir}: check the network (or HF_ENDPOINT, proxy "
                "variables), fill the cache elsewhere and copy it, or pass a local directory"
            )
        if isinstance(e, HfHubHTTPError):
            status = e.response.status_code if e.response is not None else "error"
            todo = (
                "set HF_TOKEN to a valid token"
                if status in (401, 403)
                else "try again later, or pass a local directory"
            )
            return f"the Hugging Face Hub answered HTTP {status} for {self.what}: {todo}"
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return (
            f"downloading {self.what} into {self.cache_dir} failed "
            f"({type(e).__name__}{': ' + first if first else ''})"
        )
