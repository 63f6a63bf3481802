"""The offline LLM's text: skip_special_tokens is honoured, the stop token's text is left out."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models

from engine_svc import LLM, SamplingParams

VOCAB = 384  # the tiny checkpoints' vocab_size


def _odd_ids_special(model_dir: Path) -> None:
    """A word-level tokenizer over the whole vocabulary ("w0 w1 ..."); every odd id is special,
    so any generated run of a few tokens mixes special and ordinary ones."""
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.add_special_tokens([AddedToken(f"w{i}", special=True) for i in range(1, VOCAB, 2)])
    tok.save(str(model_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def model_dir(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("llm_text") / "llama"
    shutil.copytree(tiny_models["llama"], d)
    _odd_ids_special(d)
    return d


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(model_dir, dtype="float32", num_kv_blocks=64, device="cpu")


PROMPTS = [[random.Random(i).randrange(4, VOCAB) for _ in range(8)] for i in range(4)]


def _generate(llm: LLM, **kw: object) -> list[tuple[list[int], str, str | None, int | None]]:
    params = SamplingParams(max_tokens=16, temperature=0.0, **kw)  # type: ignore[arg-type]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            o.outputs[0].text,
            o.outputs[0].finish_reason,
            o.outputs[0].stop_reason,
        )
        for o in outs
    ]


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_is_honoured(llm: LLM, skip: bool) -> None:
    tok = llm.get_tokenizer()
    results = _generate(llm, ignore_eos=True, skip_special_tokens=skip)
    all_ids = [t for ids, _, _, _ in results for t in ids]
    assert any(t % 2 for t in all_ids) and any(t % 2 == 0 for t in all_ids)  # both kinds
    for ids, text, finish, _ in results:
        assert finish == "length"
        assert text == tok.decode(ids, skip_special_tokens=skip)
    specials_shown = any(
        f"w{t}" in text.split() for ids, text, _, _ in results for t in ids if t % 2
    )
    assert specials_shown == (not skip)


def _ordinary_token_after_a_few(
    results: list[tuple[list[int], str, str | None, int | None]],
) -> tuple[int, int]:
    """(prompt index, token): an ordinary (even, shown) token first generated after two others."""
    for i, (ids, _, _, _) in enumerate(results):
        for k, t in enumerate(ids):
            if t % 2 == 0 and ids.index(t) == k >= 2:
                return i, t
    raise AssertionError(f"no suitable token in {results}")


@pytest.mark.parametrize("skip", [True, False])
def test_stop_token_text_is_left_out(llm: LLM, skip: bool) -> None:
    free = _generate(llm, ignore_eos=True, skip_special_tokens=skip)
    i, stop = _ordinary_token_after_a_few(free)
    want = free[i][0][: free[i][0].index(stop) + 1]
    got = _generate(llm, ignore_eos=True, skip_special_tokens=skip, stop_token_ids=[stop])[i]
    assert (got[0], got[2], got[3]) == (want, "stop", stop)  # the id stays...
    assert got[1] == llm.get_tokenizer().decode(
        want[:-1], skip_special_tokens=skip
    )  # ...not its text
    assert not got[1].endswith(f"w{stop}")


def test_eos_text_is_left_out(llm: LLM, model_dir: Path, tmp_path: Path) -> None:
    """The engine's EOS (generation_config.json) ends the sequence; its text is not shown."""
    free = _generate(llm, ignore_eos=True)
    i, eos = _ordinary_token_after_a_few(free)
    d = tmp_path / "model"
    shutil.copytree(model_dir, d)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((d / name).read_text())
        config["eos_token_id"] = eos
        (d / name).write_text(json.dumps(config))
    with_eos = LLM(d, dtype="float32", num_kv_blocks=64, device="cpu")
    got = _generate(with_eos)[i]
    want = free[i][0][: free[i][0].index(eos) + 1]
    assert (got[0], got[2], got[3]) == (want, "stop", None)
    assert got[1] == with_eos.get_tokenizer().decode(want[:-1], skip_special_tokens=True)
    assert not got[1].endswith(f"w{eos}")
