"""``python -m engine_svc --model ORG/NAME`` as vLLM users type it, with no network: the repo
comes from a Hugging Face cache laid out here (``--download-dir``, ``HF_HUB_OFFLINE=1``), the
tokenizer from another cached repo (``--tokenizer``), the chat template from the command line
(``--chat-template``, inline), and a real gateway renders chats with that template. A repo that
is not cached stops the engine with one line and exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from engine_svc.default_model import default_model_dir
from engine_svc.model_source import TOKENIZER_MARKERS
from protos.tandem.engine.v1 import engine_pb2 as pb
from protos.tandem.engine.v1 import engine_pb2_grpc as pb_grpc
from tests.hub_cache import add_to_hub_cache
from tests.integration.harness import Engine, Gateway, child_env, free_port

pytestmark = pytest.mark.timeout(180)
MODEL = "tandem-test/tiny-chat"
TOKENIZER = "tandem-test/tiny-tok"
TOKENIZER_TEMPLATE = "{% for m in messages %}TOK {{ m['content'] }}{% endfor %}"
# Typed as a shell user would: the \n is two characters, decoded to a newline (vLLM's rule).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}\\n{% endfor %}"
)


@pytest.fixture(scope="module")
def hub(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Hugging Face cache holding the embedded model as MODEL and its tokenizer, with another
    chat template, as TOKENIZER."""
    root = tmp_path_factory.mktemp("hf-hub")
    model = add_to_hub_cache(root, MODEL, default_model_dir())
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = TOKENIZER_TEMPLATE
    files = {"tokenizer.json": (model / "tokenizer.json").read_bytes()}
    tokenizer = add_to_hub_cache(
        root, TOKENIZER, {**files, "tokenizer_config.json": json.dumps(config)}
    )
    return {"cache": root, "model": model, "tokenizer": tokenizer}


@pytest.fixture(scope="module")
def offline_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """HF_HUB_OFFLINE=1 and an empty default cache, for the processes started here."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("HF_HUB_CACHE", str(tmp_path_factory.mktemp("empty-default-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def hub_engine(
    hub: dict[str, Path], offline_env: None, cache_dir: Path, log_dir: Path
) -> Iterator[Engine]:
    engine = Engine(
        cache_dir,
        log_dir,
        *("--model", MODEL, "--download-dir", str(hub["cache"])),
        *("--tokenizer", TOKENIZER, "--chat-template", CHAT_TEMPLATE),
        *("--kv-cache-memory", "16MiB", "--max-num-seqs", "4"),
    )
    try:
        yield engine.wait_ready()
    finally:
        engine.stop()


def test_the_engine_serves_the_cached_repo_under_its_id(
    hub_engine: Engine, hub: dict[str, Path]
) -> None:
    with grpc.insecure_channel(hub_engine.address) as ch:
        stub = pb_grpc.EngineStub(ch)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        chunks = list(stub.GetTokenizer(pb.GetTokenizerRequest(), timeout=10))
    assert info.served_model_name == MODEL
    assert info.model_source == str(hub["model"])
    files: dict[str, bytes] = {}
    for c in chunks:
        files[c.file_name] = files.get(c.file_name, b"") + c.data
    # --tokenizer's files, --chat-template's template (in the field and as the file).
    tokenizer_config = (hub["tokenizer"] / "tokenizer_config.json").read_bytes()
    assert files["tokenizer_config.json"] == tokenizer_config
    rendered = CHAT_TEMPLATE.replace("\\n", "\n")
    assert chunks[0].chat_template == rendered
    assert files["chat_template.jinja"].decode() == rendered
    assert set(files) & set(TOKENIZER_MARKERS) == {"tokenizer.json"}


def test_a_gateway_renders_chats_with_the_engine_template(
    hub_engine: Engine, cache_dir: Path, log_dir: Path
) -> None:
    gateway = Gateway(hub_engine.address, cache_dir, log_dir).wait_healthy()
    try:
        models = httpx.get(f"{gateway.url}/v1/models", headers=gateway.headers, timeout=10)
        assert [m["id"] for m in models.json()["data"]] == [MODEL]
        messages = [{"role": "user", "content": "hello"}, {"role": "user", "content": "world"}]
        tokens = httpx.post(
            f"{gateway.url}/tokenize",
            json={"model": MODEL, "messages": messages, "add_generation_prompt": False},
            headers=gateway.headers,
            timeout=10,
        ).json()["tokens"]
        text = httpx.post(
            f"{gateway.url}/detokenize",
            json={"model": MODEL, "tokens": tokens},
            headers=gateway.headers,
            timeout=10,
        ).json()["prompt"]
        assert text == "<|im_start|>user: hello\n<|im_start|>user: world\n"
        chat = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 2},
            headers=gateway.headers,
            timeout=30,
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == len(tokens)
    finally:
        gateway.stop()


def test_a_repo_missing_offline_exits_2_in_one_line(
    hub: dict[str, Path], offline_env: None, cache_dir: Path
) -> None:
    argv = [sys.executable, "-m", "engine_svc", "--port", str(free_port())]
    argv += ["--model", "tandem-test/absent", "--download-dir", str(hub["cache"])]
    done = subprocess.run(
        argv, env=child_env(cache_dir), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr == (
        "python -m engine_svc: error: model 'tandem-test/absent' (revision main) is not in the "
        f"Hugging Face cache {hub['cache']} and HF_HUB_OFFLINE is set: download it first (hf "
        f"download tandem-test/absent --cache-dir {hub['cache']}), unset HF_HUB_OFFLINE, or "
        "pass a local directory\n"
    )
    assert "TANDEM_ENGINE_READY" not in done.stdout
