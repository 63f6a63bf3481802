"""Compiles structured-output constraints against the served tokenizer, off the engine loop.

    EngineCore.add_request ──grammar_for(params)──► LRU cache hit? ──► the same future
                                                    miss ──► pool thread: compile ──► future
    Scheduler: request WAITING_FOR_GRAMMAR until future.done() (other requests run meanwhile)

A small thread pool compiles (xgrammar releases the GIL while it works, so the loop thread
keeps stepping). The cache holds futures, so requests asking for a grammar that is still
compiling share that compilation. A grammar that does not compile is cached too (its error is
as deterministic as its success); an unexpected failure is not. The compiler itself (xgrammar and
the tokenizer) is built by the first compilation; when it cannot be (no tokenizer files), every
constraint fails with that reason.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from engine_svc.core.sampling_params import StructuredOutputParams
from engine_svc.structured_output.grammar import GrammarError, RequestGrammar

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256
# JSON may be laid out freely (pretty-printed is fine), but one run of whitespace is at most this
# long: small models otherwise tend to emit newlines forever once inside a JSON grammar (vLLM's
# "disable_any_whitespace" answers the same problem). 32 fits a 4-space indent 7 levels deep.
MAX_JSON_WHITESPACE = 32
_OBJECT = '{"type": "object"}'
_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarUnavailableError(GrammarError):
    """This engine cannot compile constraints (xgrammar missing, no tokenizer files)."""


class StructuredOutputManager:
    """Hands out ``RequestGrammar`` objects; owns the compiler, its pool and the cache.

    ``tokenizer_dir`` holds the served model's Hugging Face tokenizer, ``vocab_size`` is the
    width of the model's logits (may exceed the tokenizer's vocabulary; the extra ids are never
    allowed) and ``eos_token_ids`` end a complete text. Used from the engine loop thread only
    (the pool threads touch nothing but the compiler).
    """

    def __init__(
        self,
        tokenizer_dir: str | Path,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        cache_size: int = DEFAULT_CACHE_SIZE,
        max_workers: int | None = None,
    ) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be at least 1, got {cache_size}")
        self.tokenizer_dir = Path(tokenizer_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.cache_size = cache_size
        # A few compilations at once (one huge schema does not hold up the small ones), each
        # with as many threads of its own; half the cores in all, the rest are the engine's.
        self.max_workers = max_workers or _half_the_cores(4)
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._in_flight: set[Future[Any]] = set()
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built by the first compilation
        self._compiler_error: GrammarUnavailableError | None = None
        self._compiler_lock = threading.Lock()
        self.num_compiled = 0  # compilations started (cache misses), for tests and logs

    # ------------------------------------------------------------------ the loop thread
    def grammar_for(self, params: StructuredOutputParams) -> RequestGrammar:
        """The grammar of ``params``: from the cache, or compiling from now on."""
        key = params.key
        future = self._cache.get(key)
        if future is not None and _failed_unexpectedly(future):
            future = None  # not the spec's fault: try again
        if future is None:
            future = self._executor().submit(self._compile, *key)
            self.num_compiled += 1
            self._in_flight.add(future)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)  # a request still holding its future keeps it
        else:
            self._cache.move_to_end(key)
        return RequestGrammar(params.kind, future, params.reasoning_end_token_ids)

    def wait_for_any(self, timeout_s: float) -> bool:
        """Block until a compilation in flight finishes or ``timeout_s`` passes; False at once
        when none is in flight. For a loop with nothing to run but requests waiting for their
        grammar: sleeping here instead of spinning leaves the CPU to the compiler."""
        self._in_flight = {f for f in self._in_flight if not f.done()}
        if not self._in_flight:
            return False
        wait(self._in_flight, timeout=timeout_s, return_when=FIRST_COMPLETED)
        return True

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="grammar")
        return self._pool

    # ------------------------------------------------------------------ pool threads
    def _compile(self, kind: str, spec: str) -> Any:
        compiler = self._get_compiler()
        try:
            if kind in ("json_schema", "json_object"):
                schema = json_schema_for_xgrammar(spec) if kind == "json_schema" else _OBJECT
                return compiler.compile_json_schema(
                    schema, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE
                )
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(spec)))
            if kind == "grammar":
                return compiler.compile_grammar(spec)
        except Exception as e:
            raise GrammarError(f"structured_output.{kind}: {_xgrammar_message(e)}") from None
        raise GrammarError(f"structured_output: unknown kind {kind!r}")

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None and self._compiler_error is None:
                try:
                    self._compiler = self._build_compiler()
                except GrammarUnavailableError as e:
                    self._compiler_error = e
            if self._compiler_error is not None:
                raise self._compiler_error
            return self._compiler

    def _build_compiler(self) -> Any:
        try:
            import xgrammar as xgr
            from transformers import AutoTokenizer
        except ImportError as e:
            raise GrammarUnavailableError(
                f"structured_output: this engine cannot compile constraints ({e}); install "
                "the engine's xgrammar dependency"
            ) from None
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer_dir))
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer,
                vocab_size=self.vocab_size,
                stop_token_ids=list(self.eos_token_ids) or None,
            )
        except Exception as e:
            raise GrammarUnavailableError(
                "structured_output: this engine cannot compile constraints: the served model's "
                f"tokenizer at {self.tokenizer_dir} does not load ({e})"
            ) from None
        threads = _half_the_cores(8)
        logger.info(
            "structured outputs: xgrammar compiler for %s (vocab %d, %s)",
            self.tokenizer_dir,
            self.vocab_size,
            info.vocab_type.name,
        )
        return xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)


def json_schema_for_xgrammar(spec: str) -> str:
    """The schema with every length-bounded string written as a pattern, the same bound.

    xgrammar (0.2.8) compiles ``minLength``/``maxLength`` to a character class that lets raw
    control characters (U+0000-U+001F but CR and LF) into the string, which is not JSON: a strict
    parser refuses the output (mlc-ai/xgrammar#800). Its ``pattern`` path keeps them out, so a
    string with a length bound and no other content rule becomes ``^[\\s\\S]{min,max}$`` (the
    same bounds; neither path emits escapes). Remove once xgrammar is fixed.
    """
    schema = json.loads(spec)
    rewritten = _bounded_strings_as_patterns(schema)
    return spec if rewritten is schema else json.dumps(rewritten)


_NOT_SCHEMAS = ("enum", "const", "default", "examples")  # keys whose values are data


def _bounded_strings_as_patterns(node: Any) -> Any:
    """``node`` with the rewrite applied below it; the same object when nothing changed."""
    if isinstance(node, list):
        items = [_bounded_strings_as_patterns(v) for v in node]
        return node if all(a is b for a, b in zip(items, node, strict=True)) else items
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _NOT_SCHEMAS else _bounded_strings_as_patterns(v) for k, v in node.items()}
    lo, hi = node.get("minLength"), node.get("maxLength")
    if (
        node.get("type") == "string"
        and (isinstance(lo, int) or isinstance(hi, int))
        and not any(k in node for k in ("pattern", "format", *_NOT_SCHEMAS))
    ):
        out.pop("minLength", None)
        out.pop("maxLength", None)
        low = lo if isinstance(lo, int) else 0
        out["pattern"] = f"^[\\s\\S]{{{low},{hi if isinstance(hi, int) else ''}}}$"
        return out
    return node if all(out[k] is node[k] for k in node) else out


def _half_the_cores(at_most: int) -> int:
    return max(1, min(at_most, (os.cpu_count() or 2) // 2))


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose texts are exactly ``choices``. JSON string literals are EBNF string
    literals (the same escapes); non-ASCII characters are written as they are."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _xgrammar_message(e: Exception) -> str:
    """xgrammar's error without its C++ source location: '[12:42:06] /project/cpp/x.cc:83: '."""
    text = str(e).strip() or type(e).__name__
    return _XGRAMMAR_LOCATION.sub("", text).strip()


def _failed_unexpectedly(future: Future[Any]) -> bool:
    if not future.done() or future.cancelled():
        return future.cancelled()
    error = future.exception()
    return error is not None and (
        not isinstance(error, GrammarError) or isinstance(error, GrammarUnavailableError)
    )
