"""benchmarks/step_timeline.py, which ``throughput.py --timeline`` and ``step_anatomy.py`` use:
one row per engine step with what it scheduled, phases that add up to the step, and the engine
left as it was found."""

from __future__ import annotations

import sys
from pathlib import Path

from engine_svc import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from step_timeline import StepTimeline, batch_bands  # type: ignore[import-not-found]  # noqa: E402


def test_rows_count_what_each_step_scheduled(tiny_models: dict[str, Path]) -> None:
    llm = LLM(tiny_models["llama"], dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64)
    core = llm.engine
    steps = []
    step = core.step

    def counted() -> object:
        steps.append(1)
        return step()

    prompts = [[5 + i for i in range(n)] for n in (10, 30, 3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    core.step = counted  # type: ignore[method-assign]
    with StepTimeline(core) as timeline:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del core.step
    rows = timeline.rows
    assert len(rows) == len(steps)
    first = rows[0]  # every prompt fits the 64-token budget: one prefill step
    assert (first["rows"], first["prefill_tokens"], first["decode_rows"]) == (3, 43, 0)
    assert first["context"] == 43 and not first["decode_only"]
    decodes = [r for r in rows if r["decode_only"]]
    assert len(decodes) == 5 and all(r["decode_rows"] == 3 for r in decodes)
    assert decodes[0]["context"] == 43 + 3  # each row's context includes its new token
    for r in rows:
        inside = r["schedule_ms"] + r["execute_ms"] + r["update_ms"] + r["timeline_ms"]
        assert abs(inside - r["step_ms"]) < 1e-6 and r["sched_update_ms"] <= r["update_ms"]
    s = timeline.summary(max_num_seqs=64)
    assert s["steps"] == 6 and s["decode_steps"] == 5 and s["prefill_tokens"] == 43
    assert s["decode_bands"][0]["steps"] == 5 and s["decode_bands"][0]["mean_rows"] == 3
    # Detached: the instance's own attributes are gone, the class's methods show through.
    assert "step" not in vars(core) and "schedule" not in vars(core.scheduler)
    assert "execute" not in vars(core.runner)


def test_batch_bands_scale_with_max_num_seqs() -> None:
    assert batch_bands(256) == [(1, 32), (33, 128), (129, 200), (201, 256)]
    assert batch_bands(64) == [(1, 8), (9, 32), (33, 50), (51, 64)]
    assert batch_bands(4) == [(1, 1), (2, 2), (3, 3), (4, 4)]
