"""The offline pooling API with LoRA adapters equals transformers + PEFT (float32, tiny random
weights): ``embed`` of one batch mixing two adapters and the base model, ``classify`` of a
sequence classifier (the adapter changes the decoder, the score head stays the base's), ``score``
through embedding cosine and through a cross-encoder; and ``lora_request`` is refused where
``generate`` refuses it, with the same error, leaving nothing behind."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine_svc import LLM, LoRARequest
from engine_svc.lora.errors import LoRADisabledError
from tests.lora_peft import ALL_TARGETS, load_peft, make_adapter
from tests.parity.pooling_reference import (
    TOL,
    embedding,
    last_hidden_state,
    random_prompts,
    token_prompts,
)

# Explicit target lists (no "all-linear"): on a sequence classifier PEFT would take the score
# head for a linear layer, and the head is not an adapter target here (nor in vLLM).
ADAPTERS: dict[str, dict[str, Any]] = {
    "qv": dict(r=4, alpha=8, targets=["q_proj", "v_proj"]),
    "all": dict(r=8, alpha=16, targets=ALL_TARGETS, use_rslora=True),
}
IDS = {name: i + 1 for i, name in enumerate(ADAPTERS)}
NUM_BLOCKS = 256
# An adapter moves a vector by far more than the parity tolerance (else parity proves nothing).
MIN_EFFECT = 1e-2

Family = tuple[Path, dict[str, Path], Any]  # base checkpoint, adapter dirs, PEFT model


def _adapters(base: Path, root: Path) -> dict[str, Path]:
    return {
        name: make_adapter(base, root / name, seed=20 + i, **cfg)
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }


def _requests(names: list[str | None], dirs: dict[str, Path]) -> list[LoRARequest | None]:
    return [None if n is None else LoRARequest(n, IDS[n], str(dirs[n])) for n in names]


def _with_adapter(peft_model: Any, adapter: str | None, run: Callable[[], Any]) -> Any:
    """``run()`` with ``adapter`` active in ``peft_model`` (None: every adapter off)."""
    if adapter is None:
        with peft_model.disable_adapter():
            return run()
    peft_model.set_adapter(adapter)
    return run()


def _peft_embedding(
    peft_model: Any, prompt: list[int], adapter: str | None, pooling: str, normalize: bool = True
) -> np.ndarray:
    decoder = peft_model.get_base_model().model  # the decoder inside *ForCausalLM, LoRA layers in
    states = _with_adapter(peft_model, adapter, lambda: last_hidden_state(decoder, prompt))
    return embedding(states, pooling, normalize)


def _peft_logits(peft_model: Any, prompt: list[int], adapter: str | None) -> torch.Tensor:
    ids = torch.tensor([prompt])

    def run() -> torch.Tensor:
        with torch.inference_mode():
            logits: torch.Tensor = peft_model(input_ids=ids).logits[0]
        return logits

    return _with_adapter(peft_model, adapter, run)


def _load_peft_classifier(base: Path, adapters: dict[str, Path]) -> Any:
    """``load_peft`` for a sequence classifier: transformers' classifier of ``base`` with every
    adapter of ``adapters`` loaded by PEFT under its name."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(base), dtype=torch.float32)
    (first, path), *rest = adapters.items()
    peft_model = PeftModel.from_pretrained(model.eval(), str(path), adapter_name=first)
    for name, path in rest:
        peft_model.load_adapter(str(path), adapter_name=name)
    return peft_model.eval()


def _lora_llm(base: Path, **kw: Any) -> LLM:
    return LLM(
        base,
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        num_kv_blocks=NUM_BLOCKS,
        block_size=4,
        max_num_batched_tokens=32,  # longer prompts are chunked; chunks of both adapters mix
        **kw,
    )


def _assert_clean(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    llm.engine.step()  # the runner drops the rows of the last finished requests
    assert llm.engine.kv.num_free_blocks == NUM_BLOCKS
    assert llm.engine.runner.input_batch.num_rows == 0


@pytest.fixture(scope="module", params=["embed-LAST", "llama-MEAN"])
def embed_family(
    request: pytest.FixtureRequest,
    tiny_models: dict[str, Path],
    tiny_pooling_models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, dict[str, Path], Any, str]]:
    """(base, adapter dirs, PEFT model, pooling type): the Qwen3 embedding model (LAST, as its
    sentence-transformers files say) and a Llama causal LM embedded with MEAN pooling."""
    name, pooling = request.param.split("-")
    base = tiny_pooling_models[name] if name == "embed" else tiny_models[name]
    dirs = _adapters(base, tmp_path_factory.mktemp(f"lora_embed_{name}"))
    yield base, dirs, load_peft(base, dirs), pooling


# ---------------------------------------------------------------------------------- embed
def test_embed_mixes_adapters_and_base_per_prompt(
    embed_family: tuple[Path, dict[str, Path], Any, str],
) -> None:
    base, dirs, peft_model, pooling = embed_family
    llm = _lora_llm(base, pooling_type=pooling)
    prompts = random_prompts([3, 17, 40, 9, 25, 33, 1], seed=11)
    names: list[str | None] = ["qv", None, "all", "all", "qv", None, "qv"]
    outs = llm.embed(token_prompts(prompts), use_tqdm=False, lora_request=_requests(names, dirs))
    for p, name, out in zip(prompts, names, outs, strict=True):
        assert out.prompt_token_ids == p
        want = _peft_embedding(peft_model, p, name, pooling)
        np.testing.assert_allclose(out.outputs.embedding, want, **TOL, err_msg=str(name))
        if name is not None:  # the adapter was applied, not ignored
            base_vec = _peft_embedding(peft_model, p, None, pooling)
            assert np.abs(np.asarray(out.outputs.embedding) - base_vec).max() > MIN_EFFECT, name

    # Each prompt again under another adapter (or none): parity again, and with LAST pooling
    # (which looks the prefix cache up) no block cached under another adapter is read.
    other: dict[str | None, str | None] = {"qv": "all", "all": None, None: "qv"}
    moved = [other[n] for n in names]
    again = llm.embed(token_prompts(prompts), use_tqdm=False, lora_request=_requests(moved, dirs))
    for p, name, out in zip(prompts, moved, again, strict=True):
        assert out.num_cached_tokens == 0, name
        want = _peft_embedding(peft_model, p, name, pooling)
        np.testing.assert_allclose(out.outputs.embedding, want, **TOL, err_msg=str(name))
    if pooling == "LAST":  # ... while the same adapter does read its own blocks
        same = llm.embed(
            token_prompts(prompts), use_tqdm=False, lora_request=_requests(names, dirs)
        )
        assert [o.num_cached_tokens for o in same] == [(len(p) - 1) // 4 * 4 for p in prompts]
        for a, b in zip(outs, same, strict=True):
            np.testing.assert_allclose(b.outputs.embedding, a.outputs.embedding, **TOL)

    # One LoRARequest for every prompt (already loaded: no path needed), raw vectors.
    raw = llm.embed(
        token_prompts(prompts), normalize=False, use_tqdm=False, lora_request=LoRARequest("all", 2)
    )
    for p, out in zip(prompts, raw, strict=True):
        want = _peft_embedding(peft_model, p, "all", pooling, normalize=False)
        np.testing.assert_allclose(out.outputs.embedding, want, **TOL)
    _assert_clean(llm)


# ---------------------------------------------------------------------------------- classify
@pytest.mark.parametrize("name", ["classify_llama", "classify_qwen3"])
def test_classify_with_adapters_matches_peft(
    tiny_pooling_models: dict[str, Path], tmp_path: Path, name: str
) -> None:
    base = tiny_pooling_models[name]
    dirs = _adapters(base, tmp_path)
    peft_model = _load_peft_classifier(base, dirs)
    llm = _lora_llm(base)
    prompts = random_prompts([5, 40, 1, 22, 13], seed=12)
    names: list[str | None] = ["all", "qv", None, "qv", "all"]
    logits = llm.classify(
        token_prompts(prompts),
        activation=False,
        use_tqdm=False,
        lora_request=_requests(names, dirs),
    )
    probs = llm.classify(
        token_prompts(prompts), use_tqdm=False, lora_request=_requests(names, dirs)
    )
    for p, adapter, lo, pr in zip(prompts, names, logits, probs, strict=True):
        want = _peft_logits(peft_model, p, adapter)
        assert lo.outputs.num_classes == 3
        np.testing.assert_allclose(lo.outputs.probs, want.numpy(), **TOL, err_msg=str(adapter))
        np.testing.assert_allclose(pr.outputs.probs, torch.softmax(want, -1).numpy(), **TOL)
        if adapter is not None:
            base_logits = _peft_logits(peft_model, p, None)
            assert (want - base_logits).abs().max().item() > MIN_EFFECT, adapter
    _assert_clean(llm)


# ---------------------------------------------------------------------------------- score
def test_embedding_cosine_score_with_an_adapter(
    tiny_pooling_models: dict[str, Path], tmp_path: Path
) -> None:
    base = tiny_pooling_models["embed"]
    dirs = _adapters(base, tmp_path)
    peft_model = load_peft(base, dirs)
    llm = _lora_llm(base)
    tok = llm.get_tokenizer()
    assert tok is not None
    query, docs = "the quick brown fox", ["a lazy dog", "hello world", "the quick brown fox"]

    def cosines(adapter: str | None) -> list[float]:
        q = _peft_embedding(peft_model, tok.encode(query), adapter, "LAST")
        return [
            float(q @ _peft_embedding(peft_model, tok.encode(d), adapter, "LAST")) for d in docs
        ]

    (lr,) = _requests(["all"], dirs)
    scores = [s.outputs.score for s in llm.score(query, docs, use_tqdm=False, lora_request=lr)]
    assert scores == pytest.approx(cosines("all"), abs=1e-5)
    assert scores[2] == pytest.approx(1.0, abs=1e-5)
    base_scores = [s.outputs.score for s in llm.score(query, docs, use_tqdm=False)]
    assert base_scores == pytest.approx(cosines(None), abs=1e-5)
    assert max(abs(a - b) for a, b in zip(scores, base_scores, strict=True)) > MIN_EFFECT
    pairwise = llm.score(docs[:2], docs[1:], use_tqdm=False, lora_request=lr)  # N:N
    d1, d2 = (_peft_embedding(peft_model, tok.encode(d), "all", "LAST") for d in docs[1:])
    assert pairwise[1].outputs.score == pytest.approx(float(d1 @ d2), abs=1e-5)
    _assert_clean(llm)


def test_cross_encoder_score_with_an_adapter(
    tiny_pooling_models: dict[str, Path], tmp_path: Path
) -> None:
    base = tiny_pooling_models["cross_encoder"]
    dirs = _adapters(base, tmp_path)
    peft_model = _load_peft_classifier(base, dirs)
    llm = _lora_llm(base)
    tok = llm.get_tokenizer()
    assert tok is not None
    query, docs = "what is a fox", ["the quick brown fox", "a lazy dog", "numbers 1 2 3"]
    (lr,) = _requests(["qv"], dirs)
    scores = llm.score(query, docs, use_tqdm=False, lora_request=lr)
    raw = llm.score([query] * 3, docs, activation=False, use_tqdm=False, lora_request=lr)
    for doc, s, r in zip(docs, scores, raw, strict=True):
        ids = tok(query, text_pair=doc)["input_ids"]
        assert s.prompt_token_ids == ids
        logit = _peft_logits(peft_model, ids, "qv")[0]
        assert r.outputs.score == pytest.approx(float(logit), abs=2e-5)
        assert s.outputs.score == pytest.approx(float(torch.sigmoid(logit)), abs=2e-5)
        base_logit = _peft_logits(peft_model, ids, None)[0]
        assert abs(float(logit - base_logit)) > MIN_EFFECT
    _assert_clean(llm)


# ---------------------------------------------------------------------------------- errors
def _same_error_as_generate(
    llm: LLM, pool: Callable[[Any], object], prompts: list[dict[str, list[int]]], lora: Any
) -> str:
    """``pool(lora)`` raises what ``generate(prompts, lora_request=lora)`` raises; the message."""
    with pytest.raises(ValueError) as generated:
        llm.generate(prompts, use_tqdm=False, lora_request=lora)
    with pytest.raises(ValueError) as pooled:
        pool(lora)
    assert type(pooled.value) is type(generated.value)
    assert str(pooled.value) == str(generated.value)
    return str(pooled.value)


def test_lora_request_errors_match_generate(
    tiny_pooling_models: dict[str, Path], tmp_path: Path
) -> None:
    base = tiny_pooling_models["embed"]  # serves generate and embed: both can be asked
    path = make_adapter(base, tmp_path / "qv", seed=7, **ADAPTERS["qv"])
    prompts = token_prompts(random_prompts([4, 9, 14], seed=13))
    texts = ["a lazy dog", "hello world"]
    llm = _lora_llm(base)

    def embed(lora: Any) -> object:
        return llm.embed(prompts, use_tqdm=False, lora_request=lora)

    # a list of the wrong length
    msg = _same_error_as_generate(llm, embed, prompts, [LoRARequest("qv", 1, str(path))] * 2)
    assert msg == "got 2 lora_requests for 3 prompts"
    with pytest.raises(ValueError, match="got 4 lora_requests for 3 prompts"):
        llm.classify(prompts, use_tqdm=False, lora_request=[None] * 4)
    # an adapter never loaded, without lora_path
    msg = _same_error_as_generate(llm, embed, prompts, LoRARequest("nope", 3))
    assert msg == "LoRA adapter 'nope' is not loaded: give lora_path"
    with pytest.raises(ValueError, match="'nope' is not loaded: give lora_path"):
        llm.score(texts[0], texts, use_tqdm=False, lora_request=LoRARequest("nope", 3))
    # one lora_int_id naming two adapters
    llm.embed(prompts[:1], use_tqdm=False, lora_request=LoRARequest("qv", 1, str(path)))
    msg = _same_error_as_generate(llm, embed, prompts, LoRARequest("other", 1, str(path)))
    assert msg == "lora_int_id 1 already names adapter 'qv'"
    # score takes one adapter for the whole call
    with pytest.raises(ValueError, match="score takes one lora_request for the whole call"):
        llm.score(texts[0], texts, use_tqdm=False, lora_request=[None, None])  # type: ignore[arg-type]
    assert [i.name for i in llm.engine.list_loras()] == ["qv"]
    _assert_clean(llm)
    assert len(llm.embed(prompts, use_tqdm=False, lora_request=LoRARequest("qv", 1))) == 3

    # LoRA off: the adapter cannot be loaded (LoRADisabledError, as generate); without a path
    # it is simply not loaded
    plain = LLM(base, dtype="float32", num_kv_blocks=NUM_BLOCKS, block_size=4)

    def plain_embed(lora: Any) -> object:
        return plain.embed(prompts, use_tqdm=False, lora_request=lora)

    msg = _same_error_as_generate(plain, plain_embed, prompts, LoRARequest("qv", 1, str(path)))
    assert "start it with --enable-lora" in msg
    with pytest.raises(LoRADisabledError):
        plain.score(texts[0], texts, use_tqdm=False, lora_request=LoRARequest("qv", 1, str(path)))
    _same_error_as_generate(plain, plain_embed, prompts, LoRARequest("qv", 1))
    _assert_clean(plain)
    assert len(plain.embed(prompts, use_tqdm=False, lora_request=[None] * 3)) == 3
