"""One row per engine step of a run: its wall time, its phases and what it scheduled.

The rows come from wrapping, on one ``EngineCore`` instance and only while the timeline is
attached, the methods its ``step()`` calls; nothing of ``step()``'s body is copied, so the
timeline follows it when it changes::

    with StepTimeline(llm.engine) as timeline:     # core.step, scheduler.schedule,
        llm.generate(...)                          # runner.execute, scheduler.update_from_output
    timeline.summary(max_num_seqs)

A row (times in ms):

    step_ms          EngineCore.step, whole
    schedule_ms      Scheduler.schedule
    execute_ms       ModelRunner.execute (inputs, forward, sampling, the step's host sync)
    update_ms        the rest of the step: Scheduler.update_from_output (``sched_update_ms``
                     alone) and building the outputs
    gc_ms            garbage collection inside the step (``gc.callbacks``), in whichever phase
    timeline_ms      this timeline's own counting of the rows (left out of every phase)
    t_s              when the step began, from the timeline's start (s)
    rows             requests scheduled; ``decode_rows`` of them one output token each
    prefill_tokens   tokens of the other rows (prompt chunks, recomputation after preemption)
    context          sum over the rows of num_computed_tokens + new tokens
    decode_only      rows > 0 and prefill_tokens == 0

``Patches`` is the wrapping itself, shared with step_anatomy.py.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable
from typing import Any

_ABSENT = object()


class Patches:
    """Wrappers put in place of attributes (an instance's methods, a module's functions) and
    taken out again, each owner left as it was found."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []  # owner, name, its own value or _ABSENT

    def wrap(self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Any]) -> bool:
        """Put ``make(owner.name)`` in place of ``owner.name``; False (nothing done) when the
        owner has no such attribute."""
        fn = getattr(owner, name, None)
        if fn is None:
            return False
        self._saved.append((owner, name, vars(owner).get(name, _ABSENT)))
        setattr(owner, name, make(fn))
        return True

    def restore(self) -> None:
        for owner, name, own in reversed(self._saved):
            if own is _ABSENT:
                delattr(owner, name)  # the class's method shows through again
            else:
                setattr(owner, name, own)
        self._saved.clear()


def batch_bands(max_num_seqs: int) -> list[tuple[int, int]]:
    """Decode batch bands: 1-32, 33-128, 129-200, 201-256 at max_num_seqs 256, the same
    fractions of any other max_num_seqs."""
    edges: list[int] = []
    for edge in (32, 128, 200, 256):
        e = max(1, round(max_num_seqs * edge / 256))
        if not edges or e > edges[-1]:
            edges.append(e)
    return [(lo + 1, hi) for lo, hi in zip([0, *edges], edges, strict=False)]


def _ms(seconds: float) -> float:
    return 1e3 * seconds


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows) if rows else 0.0


class StepTimeline:
    """Records one row per ``core.step()`` while attached (a context manager)."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.rows: list[dict[str, Any]] = []
        self.gc_s = 0.0
        self.gc_collections = 0
        self.wall_s = 0.0
        self._patches = Patches()
        self._row: dict[str, Any] | None = None  # the step under way
        self._gc_start = 0.0
        self._start = 0.0

    # ------------------------------------------------------------------ attach / detach
    def __enter__(self) -> StepTimeline:
        core, p = self.core, self._patches
        p.wrap(core, "step", self._wrap_step)
        p.wrap(core.scheduler, "schedule", self._wrap_schedule)
        p.wrap(core.runner, "execute", functools.partial(self._timed, "execute_ms"))
        p.wrap(
            core.scheduler, "update_from_output", functools.partial(self._timed, "sched_update_ms")
        )
        gc.callbacks.append(self._on_gc)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._start
        gc.callbacks.remove(self._on_gc)
        self._patches.restore()

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        seconds = time.perf_counter() - self._gc_start
        self.gc_s += seconds
        self.gc_collections += 1
        if self._row is not None:
            self._row["gc_ms"] += _ms(seconds)

    # ------------------------------------------------------------------ the wrappers
    def _wrap_step(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def step(*args: Any, **kwargs: Any) -> Any:
            row: dict[str, Any] = {
                "t_s": time.perf_counter() - self._start,
                "step_ms": 0.0,
                "schedule_ms": 0.0,
                "execute_ms": 0.0,
                "update_ms": 0.0,
                "sched_update_ms": 0.0,
                "gc_ms": 0.0,
                "timeline_ms": 0.0,
                "rows": 0,
                "decode_rows": 0,
                "prefill_tokens": 0,
                "context": 0,
                "decode_only": False,
            }
            self._row = row
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                row["step_ms"] = _ms(time.perf_counter() - start)
                inside = row["schedule_ms"] + row["execute_ms"] + row["timeline_ms"]
                row["update_ms"] = max(0.0, row["step_ms"] - inside)
                self._row = None
                self.rows.append(row)

        return step

    def _wrap_schedule(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        timed = self._timed("schedule_ms", fn)

        @functools.wraps(fn)
        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = timed(*args, **kwargs)
            row = self._row
            if row is not None:  # counted before execute / update move the counters on
                start = time.perf_counter()
                decode = prefill = context = 0
                for s in out.scheduled:
                    request = s.request
                    computed = request.num_computed_tokens
                    context += computed + s.num_tokens
                    if s.num_tokens == 1 and computed >= request.num_prompt_tokens:
                        decode += 1  # the KV of an output token: a decode row
                    else:
                        prefill += s.num_tokens
                row.update(
                    rows=len(out.scheduled),
                    decode_rows=decode,
                    prefill_tokens=prefill,
                    context=context,
                    decode_only=bool(out.scheduled) and prefill == 0,
                )
                row["timeline_ms"] = _ms(time.perf_counter() - start)
            return out

        return schedule

    def _timed(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self._row is not None:
                    self._row[key] += _ms(time.perf_counter() - start)

        return timed

    # ------------------------------------------------------------------ the summary
    def summary(self, max_num_seqs: int) -> dict[str, Any]:
        rows = self.rows
        decode = [r for r in rows if r["decode_only"]]
        prefill = [r for r in rows if r["prefill_tokens"] > 0]
        bands = []
        for lo, hi in batch_bands(max_num_seqs):
            band = [r for r in decode if lo <= r["decode_rows"] <= hi]
            bands.append(
                {
                    "decode_rows": f"{lo}-{hi}",
                    "steps": len(band),
                    "step_ms": _mean(band, "step_ms"),
                    "schedule_ms": _mean(band, "schedule_ms"),
                    "execute_ms": _mean(band, "execute_ms"),
                    "update_ms": _mean(band, "update_ms"),
                    "mean_rows": _mean(band, "decode_rows"),
                    "mean_context": _mean(band, "context"),
                }
            )
        step_s = sum(r["step_ms"] for r in rows) / 1e3
        return {
            "wall_s": self.wall_s,
            "steps": len(rows),
            "step_s": step_s,
            "outside_steps_s": self.wall_s - step_s,  # the caller's own work between steps
            "schedule_s": sum(r["schedule_ms"] for r in rows) / 1e3,
            "execute_s": sum(r["execute_ms"] for r in rows) / 1e3,
            "update_s": sum(r["update_ms"] for r in rows) / 1e3,
            "decode_steps": len(decode),
            "decode_s": sum(r["step_ms"] for r in decode) / 1e3,
            "decode_step_ms": _mean(decode, "step_ms"),
            "decode_bands": bands,
            "prefill_steps": len(prefill),
            "prefill_s": sum(r["step_ms"] for r in prefill) / 1e3,
            "prefill_step_ms": _mean(prefill, "step_ms"),
            "prefill_tokens": sum(r["prefill_tokens"] for r in prefill),
            "empty_steps": sum(1 for r in rows if r["rows"] == 0),
            "gc_s": self.gc_s,
            "gc_collections": self.gc_collections,
        }


def print_summary(s: dict[str, Any]) -> None:
    print(
        f"timeline: {s['steps']} steps in {s['wall_s']:.2f} s ({s['step_s']:.2f} s in steps: "
        f"schedule {s['schedule_s']:.2f}, execute {s['execute_s']:.2f}, "
        f"update {s['update_s']:.2f}); GC {s['gc_s']:.3f} s in {s['gc_collections']} collections"
    )
    print(
        f"  {s['prefill_steps']} steps with prefill: {s['prefill_tokens']} tokens, "
        f"{s['prefill_s']:.2f} s, {s['prefill_step_ms']:.1f} ms each"
    )
    print(
        f"  {s['decode_steps']} decode-only steps: {s['decode_s']:.2f} s, "
        f"{s['decode_step_ms']:.2f} ms each"
    )
    for b in s["decode_bands"]:
        if b["steps"]:
            print(
                f"    rows {b['decode_rows']:>9}: {b['steps']:5d} steps  "
                f"step {b['step_ms']:7.2f} ms  (schedule {b['schedule_ms']:.2f}, "
                f"execute {b['execute_ms']:.2f}, update {b['update_ms']:.2f})  "
                f"mean context {b['mean_context']:.0f}"
            )
