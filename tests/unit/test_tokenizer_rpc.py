"""GetTokenizer serves ``--tokenizer``'s files instead of the model's, and ``--chat-template`` in
place of the tokenizer's template: in the ``chat_template`` field (which takes precedence, the
contract says) and as the ``chat_template.jinja`` file, so a client that loads the files with
transformers sees it too."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from engine_svc.rpc.servicer import EngineServicer
from protos.tandem.engine.v1 import engine_pb2 as pb

MODEL_TEMPLATE = "{{ 'model template' }}"
TOKENIZER_TEMPLATE = "{{ 'tokenizer template' }}"
OVERRIDE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"


class _Aborted(Exception):
    pass


class _Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


def _dir(path: Path, template: str, **extra: str) -> Path:
    path.mkdir()
    (path / "tokenizer.json").write_text(json.dumps({"which": path.name}))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    for name, content in extra.items():
        (path / name).write_text(content)
    return path


def _served(
    model: Path, tokenizer: Path | None = None, chat_template: str | None = None
) -> tuple[dict[str, bytes], str]:
    servicer = EngineServicer(
        cast(Any, None),
        cast(Any, None),
        str(model),
        "test",
        None if tokenizer is None else str(tokenizer),
        chat_template,
    )

    async def collect() -> list[pb.GetTokenizerResponse]:
        stream = servicer.GetTokenizer(pb.GetTokenizerRequest(), cast(Any, _Context()))
        return [msg async for msg in stream]

    chunks = asyncio.run(collect())
    files: dict[str, bytes] = {}
    for c in chunks:
        files[c.file_name] = files.get(c.file_name, b"") + c.data
    assert all(not c.chat_template for c in chunks[1:])  # the first message carries it
    return files, chunks[0].chat_template


def test_the_model_directory_by_default(tmp_path: Path) -> None:
    model = _dir(tmp_path / "model", MODEL_TEMPLATE)
    files, template = _served(model)
    assert json.loads(files["tokenizer.json"]) == {"which": "model"}
    assert template == MODEL_TEMPLATE


def test_tokenizer_files_and_template_come_from_the_tokenizer_directory(tmp_path: Path) -> None:
    model = _dir(tmp_path / "model", MODEL_TEMPLATE, **{"generation_config.json": "{}"})
    tokenizer = _dir(tmp_path / "tok", TOKENIZER_TEMPLATE, **{"generation_config.json": "[]"})
    files, template = _served(model, tokenizer)
    assert json.loads(files["tokenizer.json"]) == {"which": "tok"}
    assert template == TOKENIZER_TEMPLATE
    assert files["generation_config.json"] == b"{}"  # the model's: sampling defaults, eos


@pytest.mark.parametrize("template_files", [{}, {"chat_template.jinja": MODEL_TEMPLATE}])
def test_chat_template_override_replaces_the_template_everywhere(
    tmp_path: Path, template_files: dict[str, str]
) -> None:
    model = _dir(tmp_path / "model", MODEL_TEMPLATE, **template_files)
    files, template = _served(model, chat_template=OVERRIDE)
    assert template == OVERRIDE
    assert files["chat_template.jinja"].decode() == OVERRIDE
    assert "chat_template.json" not in files
    assert json.loads(files["tokenizer.json"]) == {"which": "model"}


def test_no_tokenizer_files_is_not_found(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    with pytest.raises(_Aborted) as info:
        _served(tmp_path / "model", chat_template=OVERRIDE)
    assert info.value.args[0] == grpc.StatusCode.NOT_FOUND
