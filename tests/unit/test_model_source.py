"""``--model`` / ``--tokenizer`` resolved as vLLM resolves them (``engine_svc.model_source``): an
existing directory wins; a Hub repo id is taken from the Hugging Face cache (built here by hand:
no network) or downloaded (a fake ``snapshot_download`` here); every failure is one line naming
the repo, the revision, the cache and what to do. And ``--chat-template``: a file, or the
template itself."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
from huggingface_hub import constants, errors

from engine_svc.model_source import (
    MODEL_PATTERNS,
    TOKENIZER_PATTERNS,
    ModelSourceError,
    read_chat_template,
    resolve_model,
    resolve_tokenizer,
)
from tests.hub_cache import add_to_hub_cache, commit_of

REPO = "tandem-test/tiny"
CHECKPOINT: dict[str, bytes | str] = {
    "config.json": '{"architectures": ["LlamaForCausalLM"]}',
    "model.safetensors": b"weights",
    "tokenizer.json": "{}",
    "tokenizer_config.json": "{}",
}


@pytest.fixture()
def cache(tmp_path: Path) -> Path:
    return tmp_path / "hub"


@pytest.fixture()
def no_download(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to reach the Hub fails the test (cache look-ups still work)."""
    real = huggingface_hub.snapshot_download

    def snapshot_download(*args: Any, **kwargs: Any) -> str:
        assert kwargs.get("local_files_only"), "tried to download"
        return str(real(*args, **kwargs))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)


# ------------------------------------------------------------------ the cache


@pytest.mark.parametrize("offline", [True, False])
@pytest.mark.usefixtures("no_download")
def test_a_cached_repo_resolves_without_the_network(cache: Path, offline: bool) -> None:
    snapshot = add_to_hub_cache(cache, REPO, CHECKPOINT)
    source = resolve_model(REPO, download_dir=cache, offline=offline)
    assert source.path == snapshot and source.repo_id == REPO


@pytest.mark.usefixtures("no_download")
def test_revision_picks_the_ref_or_the_commit(cache: Path) -> None:
    main = add_to_hub_cache(cache, REPO, CHECKPOINT)
    v2 = add_to_hub_cache(cache, REPO, CHECKPOINT, revision="v2")
    assert resolve_model(REPO, download_dir=cache, offline=True).path == main
    assert resolve_model(REPO, revision="v2", download_dir=cache, offline=True).path == v2
    commit = commit_of(REPO, "v2")
    assert resolve_model(REPO, revision=commit, download_dir=cache, offline=True).path == v2


@pytest.mark.usefixtures("no_download")
def test_hf_hub_cache_is_the_default_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = add_to_hub_cache(cache, REPO, CHECKPOINT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert resolve_model(REPO, offline=True).path == snapshot


def test_offline_miss_is_one_clear_line(cache: Path) -> None:
    with pytest.raises(ModelSourceError) as info:
        resolve_model("Qwen/Qwen3-0.6B", revision="v1", download_dir=cache, offline=True)
    message = str(info.value)
    assert message == (
        f"model 'Qwen/Qwen3-0.6B' (revision v1) is not in the Hugging Face cache {cache} and "
        "HF_HUB_OFFLINE is set: download it first (hf download Qwen/Qwen3-0.6B --revision v1 "
        f"--cache-dir {cache}), unset HF_HUB_OFFLINE, or pass a local directory"
    )


@pytest.mark.usefixtures("no_download")
def test_hf_hub_offline_is_read_from_huggingface_hub(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelSourceError, match="HF_HUB_OFFLINE is set"):
        resolve_model(REPO, download_dir=cache)


def test_an_incomplete_cached_snapshot_offline_says_what_it_lacks(cache: Path) -> None:
    add_to_hub_cache(cache, REPO, {"config.json": "{}"})  # e.g. left by AutoConfig alone
    with pytest.raises(ModelSourceError) as info:
        resolve_model(REPO, download_dir=cache, offline=True)
    assert "lacks *.safetensors weights" in str(info.value)
    assert f"in the Hugging Face cache {cache}" in str(info.value)


def test_an_incomplete_cached_snapshot_online_is_completed(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = add_to_hub_cache(cache, REPO, {"config.json": "{}"})
    real = huggingface_hub.snapshot_download
    calls: list[dict[str, Any]] = []

    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        calls.append(kwargs)
        if kwargs["local_files_only"]:
            return str(real(repo_id, **kwargs))
        (snapshot / "model.safetensors").write_bytes(b"weights")  # "downloaded"
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    source = resolve_model(REPO, revision="main", download_dir=cache, offline=False)
    assert source.path == snapshot
    local, download = calls
    assert local["local_files_only"] and not download["local_files_only"]
    assert download["revision"] == "main" and download["cache_dir"] == str(cache)
    patterns = download["allow_patterns"]
    assert patterns == list(MODEL_PATTERNS)
    assert "*.safetensors" in patterns and "*.json" in patterns
    assert not any(p.endswith((".bin", ".pt", ".pth", ".gguf", ".onnx")) for p in patterns)


# ------------------------------------------------------------------ a directory wins


@pytest.mark.usefixtures("no_download")
def test_an_existing_directory_wins_over_a_cached_repo(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_to_hub_cache(cache, REPO, CHECKPOINT)
    local = tmp_path / "work" / REPO  # ./tandem-test/tiny: spelled like the repo id
    local.mkdir(parents=True)
    for name, content in CHECKPOINT.items():
        (local / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    monkeypatch.chdir(tmp_path / "work")
    source = resolve_model(REPO, download_dir=cache, offline=True)
    assert source.path == Path(REPO) and source.repo_id is None
    assert resolve_model(local).path == local


def test_a_directory_that_is_no_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError) as info:
        resolve_model(tmp_path)
    assert str(info.value).startswith(f"model directory {tmp_path} has no config.json")
    # With a config.json it is the loader's to say what else is wrong, in its order (an
    # unsupported architecture before missing weights: test_sampling_and_logprobs.py).
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path).path == tmp_path


@pytest.mark.parametrize("name", ["/no/such/dir", "./missing", "a/b/c", "~/nope"])
def test_neither_a_directory_nor_a_repo_id(name: str) -> None:
    with pytest.raises(ModelSourceError) as info:
        resolve_model(name, offline=True)
    assert str(info.value) == (
        f"model {name!r} is neither an existing directory nor a Hugging Face Hub repo id "
        "(namespace/name)"
    )


# ------------------------------------------------------------------ downloads that fail


def _response(status: int) -> Any:
    """An HTTP response of the httpx flavour huggingface_hub's errors carry."""
    from huggingface_hub.errors import Response

    httpx = importlib.import_module(Response.__module__.split(".")[0])
    return Response(status, request=httpx.Request("GET", f"https://huggingface.co/api/{REPO}"))


def _failures() -> list[tuple[Exception, str]]:
    return [
        (
            errors.GatedRepoError("gated", response=_response(403)),
            f"model '{REPO}' (revision main) is gated on the Hugging Face Hub: accept its terms "
            f"at https://huggingface.co/{REPO} and set HF_TOKEN to a token of that account",
        ),
        (
            errors.RepositoryNotFoundError("404", response=_response(404)),
            f"model '{REPO}' (revision main) is not on the Hugging Face Hub, or is private and "
            "HF_TOKEN gives no access to it; and there is no local directory of that name",
        ),
        (
            errors.RevisionNotFoundError("404", response=_response(404)),
            f"model '{REPO}' (revision main): the Hugging Face Hub has no such revision of {REPO}",
        ),
        (
            errors.LocalEntryNotFoundError("connection refused\nsecond line"),
            f"cannot reach the Hugging Face Hub to download model '{REPO}' (revision main), and "
            "it is not in the cache {cache}: check the network (or HF_ENDPOINT, proxy "
            "variables), fill the cache elsewhere and copy it, or pass a local directory",
        ),
        (
            errors.HfHubHTTPError("401", response=_response(401)),
            f"the Hugging Face Hub answered HTTP 401 for model '{REPO}' (revision main): set "
            "HF_TOKEN to a valid token",
        ),
        (
            errors.HfHubHTTPError("503", response=_response(503)),
            f"the Hugging Face Hub answered HTTP 503 for model '{REPO}' (revision main): try "
            "again later, or pass a local directory",
        ),
        (
            OSError(28, "No space left on device"),
            f"downloading model '{REPO}' (revision main) into {{cache}} failed (OSError: [Errno "
            "28] No space left on device)",
        ),
    ]


@pytest.mark.parametrize(("error", "message"), _failures(), ids=lambda v: type(v).__name__)
def test_a_failed_download_is_one_line(
    cache: Path, monkeypatch: pytest.MonkeyPatch, error: Exception, message: str
) -> None:
    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        if kwargs["local_files_only"]:
            raise errors.LocalEntryNotFoundError("not cached")
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(ModelSourceError) as info:
        resolve_model(REPO, download_dir=cache, offline=False)
    assert str(info.value) == message.replace("{cache}", str(cache))
    assert "\n" not in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_a_downloaded_repo_without_safetensors_is_refused(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        if kwargs["local_files_only"]:
            raise errors.LocalEntryNotFoundError("not cached")
        return str(add_to_hub_cache(cache, REPO, {"config.json": "{}"}))  # a *.bin-only repo

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(ModelSourceError) as info:
        resolve_model(REPO, download_dir=cache, offline=False)
    assert str(info.value) == (
        f"model '{REPO}' (revision main) on the Hugging Face Hub has no *.safetensors weights "
        "(Tandem loads safetensors checkpoints only)"
    )


# ------------------------------------------------------------------ --tokenizer


def test_a_tokenizer_repo_resolves_from_the_cache_and_downloads_no_weights(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = add_to_hub_cache(cache, "tandem-test/tok", {"tokenizer.json": "{}"})
    assert resolve_tokenizer("tandem-test/tok", download_dir=cache, offline=True).path == snapshot
    seen: list[list[str]] = []

    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        seen.append(kwargs["allow_patterns"])
        raise errors.LocalEntryNotFoundError("not cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(ModelSourceError, match="tokenizer 'tandem-test/other'"):
        resolve_tokenizer("tandem-test/other", download_dir=cache, offline=False)
    assert seen == [list(TOKENIZER_PATTERNS)] * 2
    assert not any("safetensors" in p for p in TOKENIZER_PATTERNS)


def test_a_tokenizer_directory_needs_tokenizer_files(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError) as info:
        resolve_tokenizer(tmp_path)
    assert str(info.value) == (
        f"tokenizer directory {tmp_path} has no tokenizer files (tokenizer.json, "
        "tokenizer.model, vocab.json)"
    )
    (tmp_path / "tokenizer.model").write_bytes(b"sp")
    assert resolve_tokenizer(tmp_path).path == tmp_path


# ------------------------------------------------------------------ --chat-template


def test_chat_template_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text("{{ messages[0]['content'] }}\\n")  # a file is taken verbatim
    assert read_chat_template(str(path)) == "{{ messages[0]['content'] }}\\n"


def test_chat_template_inline_decodes_escapes_as_vllm_does() -> None:
    inline = "{% for m in messages %}{{ m['content'] }}\\n{% endfor %}« 東京 »"
    assert read_chat_template(inline) == (
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}« 東京 »"
    )


@pytest.mark.parametrize("value", ["missing.jinja", "/etc", "templates/chatml"])
def test_chat_template_that_looks_like_a_path_must_be_readable(value: str) -> None:
    with pytest.raises(ValueError) as info:
        read_chat_template(value)
    message = str(info.value)
    assert message.startswith(f"--chat-template {value!r} looks like a file path but cannot ")
    assert message.endswith("; pass a readable file or the Jinja template itself")


# ------------------------------------------------------------------ the offline LLM


def test_llm_takes_a_hub_repo_id(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine_svc import LLM, SamplingParams
    from engine_svc.default_model import default_model_dir

    add_to_hub_cache(tmp_path / "hub", REPO, default_model_dir())
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    llm = LLM(REPO, download_dir=tmp_path / "hub", kv_cache_memory="8MiB", max_num_seqs=2)
    assert llm.engine.info.served_model_name == REPO
    out = llm.generate("Hello", SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode("Hello")
    with pytest.raises(ModelSourceError, match="'tandem-test/absent' .* HF_HUB_OFFLINE is set"):
        LLM("tandem-test/absent", download_dir=tmp_path / "hub")
    with pytest.raises(ValueError, match="^trust_remote_code is not supported"):
        LLM(trust_remote_code=True)
