"""Structured outputs in the engine: constraint parameters, the grammar manager (cache,
compilation off the caller's thread, invalid grammars), the scheduler's waiting and stopping,
the batch bitmask in front of the sampler, and the whole engine under preemption."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_svc.config import SchedulerConfig
from engine_svc.core.kv_cache_manager import KVCacheManager
from engine_svc.core.request import Request, RequestStatus
from engine_svc.core.sampling_params import SamplingParams, StructuredOutputParams
from engine_svc.core.scheduler import Scheduler
from engine_svc.structured_output import GrammarError, RequestGrammar, StructuredOutputManager
from engine_svc.structured_output.bitmask import GrammarBitmask
from engine_svc.structured_output.manager import (
    GrammarUnavailableError,
    choice_grammar,
    json_schema_for_xgrammar,
)
from engine_svc.worker.sampler import Penalties, SamplingMetadata, sample
from tests.unit.grammar_helpers import EOS, VOCAB, ready

pytest.importorskip("xgrammar")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
GRAMMAR = 'root ::= "(" digit ("+" digit)? ("+" digit)? ")"\ndigit ::= [0-9]'


def _decode(tokenizer_dir: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).decode(ids)


# ---------------------------------------------------------------------------- parameters


def test_params_need_exactly_one_kind() -> None:
    with pytest.raises(ValueError, match="exactly one kind, got none"):
        StructuredOutputParams()
    with pytest.raises(ValueError, match="exactly one kind, got regex, choice"):
        StructuredOutputParams(regex="a", choice=["a"])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"json_schema": "[1, 2]"}, "json_schema must be a JSON object"),
        ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"regex": 5}, "regex must be a non-empty string"),
        ({"grammar": "   "}, "grammar must be a non-empty string"),
        ({"choice": []}, "choice must be a non-empty list of strings"),
        ({"choice": ["a", 1]}, "choice must be a non-empty list of strings"),
        ({"choice": "ab"}, "choice must be a non-empty list of strings"),
    ],
)
def test_params_shape_errors_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"structured_output.{field}"):
        StructuredOutputParams(**kwargs)


def test_params_key_is_kind_and_text() -> None:
    a = StructuredOutputParams(json_schema={"type": "object"})
    assert a.json_schema == '{"type": "object"}'  # a dict is kept as its JSON text
    assert a.key == ("json_schema", '{"type": "object"}')
    assert StructuredOutputParams(choice=["x", "y"]).key == ("choice", '["x", "y"]')
    assert StructuredOutputParams(json_object=True).key == ("json_object", "")
    assert SamplingParams(structured_output=a).structured_output is a


# ---------------------------------------------------------------------------- the manager


def test_manager_compiles_once_per_spec(tokenizer_dir: Path) -> None:
    m = StructuredOutputManager(tokenizer_dir, VOCAB, (EOS,), cache_size=2)
    a1 = m.grammar_for(StructuredOutputParams(regex="[ab]+"))
    a2 = m.grammar_for(StructuredOutputParams(regex="[ab]+"))
    assert a1.future is a2.future and m.num_compiled == 1  # shared while compiling, too
    assert a1 is not a2  # ... but every request has its own matcher
    ready(a1), ready(a2)
    m.grammar_for(StructuredOutputParams(regex="[cd]+"))
    m.grammar_for(StructuredOutputParams(regex="[ab]+"))  # a hit makes it the newest
    assert m.num_compiled == 2
    m.grammar_for(StructuredOutputParams(regex="[ef]+"))  # evicts [cd]+, the oldest
    m.grammar_for(StructuredOutputParams(regex="[ab]+"))
    assert m.num_compiled == 3
    m.grammar_for(StructuredOutputParams(regex="[cd]+"))
    assert m.num_compiled == 4
    m.shutdown()


def test_compilation_runs_off_the_calling_thread(tokenizer_dir: Path) -> None:
    m = StructuredOutputManager(tokenizer_dir, VOCAB, (EOS,))
    release = threading.Event()
    compile_real = m._compile

    def slow(kind: str, spec: str) -> Any:
        assert threading.current_thread() is not threading.main_thread()
        release.wait(30)
        return compile_real(kind, spec)

    m._compile = slow  # type: ignore[method-assign]
    grammar = m.grammar_for(StructuredOutputParams(choice=["yes", "no"]))
    assert not grammar.ready()  # returned at once; the pool thread is still working
    assert m.wait_for_any(0.01)  # times out: still compiling
    release.set()
    m.wait_for_any(30)
    assert grammar.ready() and not m.wait_for_any(0.01)  # nothing in flight any more
    m.shutdown()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"regex": "a("}, r"^structured_output\.regex: Regex parsing error .*not closed"),
        ({"grammar": 'root ::= "a" b'}, r'^structured_output\.grammar: .*Rule "b" is not defined'),
        ({"grammar": 'start ::= "a"'}, r'^structured_output\.grammar: .*"root" is not found'),
        ({"json_schema": '{"type": "wat"}'}, r'^structured_output\.json_schema: .*"wat"'),
    ],
)
def test_invalid_grammar_fails_with_the_field_named(
    manager: StructuredOutputManager, params: dict[str, str], message: str
) -> None:
    grammar = manager.grammar_for(StructuredOutputParams(**params))  # type: ignore[arg-type]
    with pytest.raises(GrammarError, match=message):
        grammar.future.result(timeout=30)
    with pytest.raises(GrammarError):
        grammar.ready()
    assert "/project/" not in str(grammar.future.exception())  # no C++ source locations
    compiled = manager.num_compiled
    again = manager.grammar_for(StructuredOutputParams(**params))  # type: ignore[arg-type]
    assert manager.num_compiled == compiled and again.future is grammar.future  # cached


def test_no_tokenizer_means_no_structured_outputs(tmp_path: Path) -> None:
    m = StructuredOutputManager(tmp_path, VOCAB, (EOS,))
    grammar = m.grammar_for(StructuredOutputParams(regex="a"))
    with pytest.raises(GrammarUnavailableError, match="cannot compile constraints"):
        grammar.future.result(timeout=30)
    m.shutdown()


def test_choice_grammar_escapes_every_choice(manager: StructuredOutputManager) -> None:
    import xgrammar as xgr

    choices = ['say "hi"', "back\\slash", "two\nlines", "tab\there", "café 🙂", "\x01", ""]
    assert choice_grammar(["a", 'b"']) == 'root ::= "a" | "b\\""'
    grammar = ready(manager.grammar_for(StructuredOutputParams(choice=choices)))
    compiled = grammar.future.result()
    for text in [*choices, "say hi"]:
        matcher = xgr.GrammarMatcher(compiled)
        accepted = matcher.accept_string(text) and matcher.is_completed()
        assert accepted == (text in choices), text


def test_length_bounded_strings_keep_control_characters_out(
    manager: StructuredOutputManager,
) -> None:
    import xgrammar as xgr

    rewritten = json.loads(json_schema_for_xgrammar(json.dumps(PERSON)))
    assert rewritten["properties"]["name"] == {"type": "string", "pattern": "^[\\s\\S]{0,6}$"}
    untouched = {"type": "string", "maxLength": 3, "enum": ["ab"], "default": {"maxLength": 1}}
    assert json_schema_for_xgrammar(json.dumps(untouched)) == json.dumps(untouched)
    grammar = ready(manager.grammar_for(StructuredOutputParams(json_schema=PERSON)))
    for name, ok in (("abc", True), ("a\x10b", False), ("a\tb", False), ("abcdefg", False)):
        matcher = xgr.GrammarMatcher(grammar.future.result())
        text = '{"name": "' + name + '", "age": 7}'
        assert (matcher.accept_string(text) and matcher.is_completed()) == ok, repr(text)


def test_string_lengths_count_characters_not_bytes(manager: StructuredOutputManager) -> None:
    """JSON Schema's minLength/maxLength count characters: two- to four-byte UTF-8 characters
    count one each, as ASCII ones do (the rewrite to a pattern keeps that)."""
    import xgrammar as xgr

    schema = {"type": "string", "minLength": 2, "maxLength": 3}
    grammar = ready(manager.grammar_for(StructuredOutputParams(json_schema=schema)))
    for text, ok in (
        ("ab", True),
        ("abc", True),
        ("abcd", False),
        ("a", False),
        ("ééé", True),  # 6 bytes
        ("日本語", True),  # 9 bytes
        ("😀😀😀", True),  # 12 bytes
        ("日本語x", False),
        ("é", False),  # 2 bytes, one character
    ):
        matcher = xgr.GrammarMatcher(grammar.future.result())
        accepted = matcher.accept_string(json.dumps(text, ensure_ascii=False))
        assert (accepted and matcher.is_completed()) == ok, text


@pytest.mark.parametrize(
    ("params", "good", "bad"),
    [
        (StructuredOutputParams(regex="a{100000}"), "aaaa", "ab"),
        (StructuredOutputParams(regex="((a{1,100}){1,100}){1,100}"), "aaa", "b"),
        (
            StructuredOutputParams(
                json_schema={"type": "array", "items": {"type": "integer"}, "minItems": 100000}
            ),
            "[1, 2",
            "[1, x",
        ),
        (
            StructuredOutputParams(json_schema={"type": "string", "maxLength": 100000}),
            '"abc',
            "abc",
        ),
    ],
)
def test_hostile_repetition_bounds_compile_without_hanging(
    manager: StructuredOutputManager, params: StructuredOutputParams, good: str, bad: str
) -> None:
    """Huge or nested repetition counts (a request can send any) compile in seconds, not
    minutes or gigabytes (xgrammar keeps the counts, it does not unroll them), and constrain."""
    import xgrammar as xgr

    grammar = ready(manager.grammar_for(params))
    assert xgr.GrammarMatcher(grammar.future.result()).accept_string(good)
    assert not xgr.GrammarMatcher(grammar.future.result()).accept_string(bad)


def test_matcher_follows_the_tokens_and_terminates_on_eos(
    manager: StructuredOutputManager, tokenizer_dir: Path
) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    grammar = ready(manager.grammar_for(StructuredOutputParams(regex=r"ab?c")))
    for t in tok.encode("ac", add_special_tokens=False).ids:
        assert grammar.accept(t)
    assert not grammar.is_terminated  # complete, but its end not yet accepted
    assert not grammar.accept(tok.token_to_id("a"))  # refused, state unchanged
    assert grammar.accept(EOS) and grammar.is_terminated
    assert grammar.num_accepted == len(tok.encode("ac", add_special_tokens=False).ids) + 1


# ---------------------------------------------------------------------------- the scheduler


class _FakeGrammar:
    """What the scheduler sees of a grammar: readiness, accept, termination."""

    def __init__(self, ready: bool = True, error: Exception | None = None) -> None:
        self.is_ready = ready
        self.error = error
        self.accepted: list[int] = []
        self.refuse: set[int] = set()
        self.end_after: int | None = None

    def ready(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.is_ready

    def accept(self, token: int) -> bool:
        if token in self.refuse:
            return False
        self.accepted.append(token)
        return True

    @property
    def is_terminated(self) -> bool:
        return self.end_after is not None and len(self.accepted) >= self.end_after


def _sched(num_blocks: int = 10, caching: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(), KVCacheManager(num_blocks, 4, enable_caching=caching), 2048)


def _req(rid: str, n: int, grammar: _FakeGrammar | None = None, **params: Any) -> Request:
    prompt = [1000 * (1 + sum(map(ord, rid))) + i for i in range(n)]
    params.setdefault("max_tokens", 8)
    request = Request(rid, prompt, SamplingParams(**params), (EOS,), float(len(rid)))
    request.grammar = grammar  # type: ignore[assignment]
    return request


def _step(sched: Scheduler, token: int = 5) -> list[str]:
    out = sched.schedule()
    sampled = {
        s.request.request_id: token
        for s in out.scheduled
        if s.request.num_computed_tokens + s.num_tokens >= s.request.num_tokens
    }
    sched.update_from_output(out, sampled)
    return [s.request.request_id for s in out.scheduled]


def test_request_waits_for_its_grammar_without_holding_up_others() -> None:
    sched = _sched()
    grammar = _FakeGrammar(ready=False)
    a, g, b = _req("a", 4), _req("g", 4, grammar), _req("b", 4)
    for r in (a, g, b):
        sched.add_request(r)
    assert g.status is RequestStatus.WAITING_FOR_GRAMMAR
    assert sched.num_waiting_for_grammar() == 1
    assert _step(sched) == ["a", "b"]  # b goes ahead of g
    assert [r.request_id for r in sched.waiting] == ["g"]  # g keeps its place
    assert g.num_computed_tokens == 0 and sched.kv.get_block_ids("g") == []
    assert _step(sched) == ["a", "b"]
    stats = sched.stats()  # vllm:num_requests_waiting_by_reason: g waits "deferred"
    assert (stats.num_waiting, stats.num_waiting_deferred) == (1, 1)
    grammar.is_ready = True
    assert _step(sched) == ["a", "b", "g"]
    assert g.status is RequestStatus.RUNNING and sched.num_waiting_for_grammar() == 0
    assert sched.stats().num_waiting_deferred == 0


def test_waiting_for_grammar_keeps_fcfs_order_among_the_others() -> None:
    sched = _sched()
    slow1, slow2 = _FakeGrammar(ready=False), _FakeGrammar(ready=False)
    reqs = [_req("g1", 4, slow1), _req("a", 4), _req("g2", 4, slow2), _req("b", 4)]
    for r in reqs:
        sched.add_request(r)
    assert _step(sched) == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["g1", "g2"]
    slow2.is_ready = True
    assert _step(sched) == ["a", "b", "g2"]
    assert [r.request_id for r in sched.waiting] == ["g1"]


def test_grammar_that_does_not_compile_fails_the_request() -> None:
    sched = _sched()
    grammar = _FakeGrammar(ready=False)
    g, b = _req("g", 4, grammar), _req("b", 4)
    sched.add_request(g)
    sched.add_request(b)
    _step(sched)
    grammar.error = GrammarError("structured_output.regex: bad")
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["b"]
    assert out.finished_ids == ["g"]  # it never had a row; nothing to free but its id
    assert g.status is RequestStatus.FINISHED_ERROR and g.finish_reason is None
    assert sched.take_errors() == [("g", grammar.error)]
    assert sched.take_errors() == []  # reported once
    assert "g" not in sched.requests and len(sched.waiting) == 0


def test_grammar_known_to_be_invalid_is_refused_at_add() -> None:
    sched = _sched()
    g = _req("g", 4, _FakeGrammar(error=GrammarError("structured_output.regex: bad")))
    with pytest.raises(GrammarError):
        sched.add_request(g)
    assert not sched.has_unfinished() and sched.take_errors() == []


def test_abort_while_compiling() -> None:
    sched = _sched()
    g = _req("g", 4, _FakeGrammar(ready=False))
    sched.add_request(g)
    sched.abort_requests(["g"])
    assert g.status is RequestStatus.FINISHED_ABORTED
    assert sched.num_waiting_for_grammar() == 0 and not sched.has_unfinished()


def test_grammar_end_stops_the_request_even_under_ignore_eos_and_min_tokens() -> None:
    sched = _sched()
    grammar = _FakeGrammar()
    grammar.end_after = 3
    g = _req("g", 4, grammar, ignore_eos=True, min_tokens=5, max_tokens=8)
    sched.add_request(g)
    for _ in range(3):
        _step(sched)
    assert g.status is RequestStatus.FINISHED_STOPPED and g.stop_reason is None
    assert g.output_token_ids == grammar.accepted == [5, 5, 5]


def test_token_the_grammar_refuses_fails_the_request() -> None:
    sched = _sched()
    grammar = _FakeGrammar()
    grammar.refuse = {7}
    g = _req("g", 4, grammar)
    sched.add_request(g)
    _step(sched, token=7)
    assert g.status is RequestStatus.FINISHED_ERROR and not sched.running
    [(rid, error)] = sched.take_errors()
    assert rid == "g" and isinstance(error, RuntimeError) and "breaks the grammar" in str(error)
    assert sched.kv.num_free_blocks == 10


def test_recompute_after_preemption_does_not_advance_the_matcher_again() -> None:
    # As test_scheduler's recompute test: b is preempted after its first token, then recomputes
    # its prompt and that token in one chunk before sampling its second.
    sched = _sched(num_blocks=3, caching=False)
    grammar = _FakeGrammar()
    a, b = _req("a", 4, max_tokens=5), _req("b", 4, grammar, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    tokens = iter(range(10, 100))
    while sched.has_unfinished():
        _step(sched, token=next(tokens))
    assert b.num_preemptions == 1
    assert b.output_token_ids == grammar.accepted and len(grammar.accepted) == 3


# ---------------------------------------------------------------------------- bitmask + sampler


def _allowed(manager: StructuredOutputManager, regex: str) -> tuple[RequestGrammar, set[int]]:
    grammar = ready(manager.grammar_for(StructuredOutputParams(regex=regex)))
    logits = torch.zeros(1, VOCAB)
    GrammarBitmask(1, VOCAB, torch.device("cpu")).apply(logits, [0], [grammar])
    return grammar, set(torch.nonzero(logits[0].isfinite()).flatten().tolist())


def test_bitmask_masks_only_the_constrained_rows(manager: StructuredOutputManager) -> None:
    digits, digit_ids = _allowed(manager, r"[0-9]+")
    letters, letter_ids = _allowed(manager, r"[a-z]+")
    assert digit_ids and letter_ids and not digit_ids & letter_ids
    assert max(digit_ids | letter_ids) < 512  # the padded ids past the tokenizer never pass
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    free = logits.clone()
    mask = GrammarBitmask(8, VOCAB, torch.device("cpu"))
    mask.apply(logits, [1, 3], [digits, letters])
    assert torch.equal(logits[0], free[0]) and torch.equal(logits[2], free[2])
    assert set(torch.nonzero(logits[1].isfinite()).flatten().tolist()) == digit_ids
    assert set(torch.nonzero(logits[3].isfinite()).flatten().tolist()) == letter_ids
    assert torch.equal(logits[1][logits[1].isfinite()], free[1][logits[1].isfinite()])


def _md(b: int, **kw: Any) -> SamplingMetadata:
    base: dict[str, Any] = dict(
        temperature=torch.ones(b), all_greedy=False, top_k=None, top_p=None, min_p=None
    )
    base.update(kw)
    return SamplingMetadata(generators={}, **base)


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": torch.zeros(64), "all_greedy": True},
        {},
        {"temperature": torch.full((64,), 2.0)},
        {"top_k": torch.full((64,), 3, dtype=torch.int64), "max_top_k": 3},
        {"top_p": torch.full((64,), 0.5)},
        {"min_p": torch.full((64,), 0.1)},
        {"max_num_logprobs": 5},
    ],
    ids=["greedy", "random", "hot", "top_k", "top_p", "min_p", "logprobs"],
)
def test_sampler_draws_only_allowed_tokens(manager: StructuredOutputManager, kw: Any) -> None:
    grammar, allowed = _allowed(manager, r"[0-9]+")
    torch.manual_seed(1)
    logits = torch.randn(64, VOCAB) * 4
    logits[:, 300] = 50.0  # the model's favourite is forbidden
    GrammarBitmask(64, VOCAB, torch.device("cpu")).apply(logits, range(64), [grammar] * 64)
    out = sample(logits, _md(64, **kw))
    assert set(out.token_ids.tolist()) <= allowed
    if out.sampled_logprobs is not None:  # logprobs of the constrained distribution
        assert out.sampled_logprobs.isfinite().all()
        probs = out.top_logprobs.exp().sum(-1)  # type: ignore[union-attr]
        assert (probs <= 1.0 + 1e-5).all()


def test_sampler_with_penalties_draws_only_allowed_tokens(
    manager: StructuredOutputManager,
) -> None:
    grammar, allowed = _allowed(manager, r"[a-z]+")
    torch.manual_seed(2)
    b = 16
    logits = torch.randn(b, VOCAB)
    GrammarBitmask(b, VOCAB, torch.device("cpu")).apply(logits, range(b), [grammar] * b)
    penalties = Penalties(
        rows=torch.arange(b),
        presence=torch.full((b,), 1.5),
        frequency=torch.full((b,), -1.0),  # a negative penalty raises logits: still -inf stays
        repetition=torch.full((b,), 1.8),
        output_counts=torch.ones(b, VOCAB, dtype=torch.int32),
        seen_mask=torch.ones(b, VOCAB, dtype=torch.bool),
    )
    for greedy in (True, False):
        md = _md(b, penalties=penalties, all_greedy=greedy, temperature=torch.full((b,), 0.7))
        assert set(sample(logits, md).token_ids.tolist()) <= allowed


# ---------------------------------------------------------------------------- the whole engine


@pytest.fixture(scope="module")
def engine_core(cache_dir: Path) -> Any:
    from engine_svc.config import CacheConfig, EngineConfig, ModelConfig
    from engine_svc.default_model import default_model_dir
    from engine_svc.engine_core import EngineCore

    config = EngineConfig(
        model=ModelConfig(str(default_model_dir()), dtype="float32"),
        cache=CacheConfig(block_size=4, num_kv_blocks=16),  # small: forces preemptions
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        device="cpu",
    )
    return EngineCore(config)


def _run(core: Any) -> list[tuple[str, Exception]]:
    errors = []
    for _ in range(2000):
        if not core.has_unfinished_requests():
            return errors
        errors += core.step().errors
    raise AssertionError("the engine did not finish")


def test_engine_constrained_outputs_survive_preemption(engine_core: Any, cache_dir: Path) -> None:
    import jsonschema

    from engine_svc.default_model import default_model_dir

    tokenizer_dir = default_model_dir()
    specs = [
        StructuredOutputParams(json_schema=PERSON),
        StructuredOutputParams(regex=r"[a-z]{2,5}-[0-9]{2}"),
        StructuredOutputParams(choice=["red", "green", "blue"]),
        StructuredOutputParams(grammar=GRAMMAR),
    ]
    requests = []
    for i in range(8):  # 8 x (prompt + output) outgrow the 64-token cache: some are preempted
        params = SamplingParams(
            max_tokens=60,
            temperature=0.0 if i % 2 else 1.0,
            seed=i,
            structured_output=specs[i % 4],
        )
        prompt = [10 + i, 20, 30 + i]
        requests.append(engine_core.add_request(f"r{i}", prompt, params))
    assert _run(engine_core) == []
    assert sum(r.num_preemptions for r in requests) > 0
    for r in requests:
        assert r.grammar is not None and r.grammar.num_accepted == r.num_output_tokens
        assert r.status is RequestStatus.FINISHED_STOPPED, r
        assert r.output_token_ids[-1] == EOS
        text = _decode(tokenizer_dir, r.output_token_ids[:-1])
        kind = r.sampling_params.structured_output.kind  # type: ignore[union-attr]
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), PERSON)
        elif kind == "regex":
            assert re.fullmatch(r"[a-z]{2,5}-[0-9]{2}", text), text
        elif kind == "choice":
            assert text in ("red", "green", "blue")
        else:
            assert re.fullmatch(r"\([0-9](\+[0-9]){0,2}\)", text), text


def test_engine_reports_a_grammar_that_does_not_compile(engine_core: Any) -> None:
    bad = SamplingParams(max_tokens=4, structured_output=StructuredOutputParams(regex="(x"))
    good = SamplingParams(max_tokens=4, temperature=0.0)
    engine_core.add_request("bad", [5, 6, 7], bad)
    engine_core.add_request("good", [5, 6, 8], good)
    errors = _run(engine_core)
    assert [rid for rid, _ in errors] == ["bad"]
    assert str(errors[0][1]).startswith("structured_output.regex: ")
    # Now cached: refused at once.
    with pytest.raises(GrammarError, match="structured_output.regex"):
        engine_core.add_request("bad2", [5, 6, 7], bad)
    assert not engine_core.has_unfinished_requests()
