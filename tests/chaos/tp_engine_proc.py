"""An engine over 2 tensor-parallel ranks generating without end, for the fault tests:
``python -m tests.chaos.tp_engine_proc MODEL_DIR`` prints ``pids ENGINE WORKER`` once ready.
A failing step is what the engine loop makes of it (logged, then the process waits: the
executor's watchdog decides how it ends)."""

from __future__ import annotations

import os
import sys
import time

from engine_svc import engine_core
from engine_svc.config import CacheConfig, EngineConfig, ModelConfig
from engine_svc.core.sampling_params import SamplingParams
from engine_svc.executor import MultiprocExecutor


def main(model_dir: str) -> None:
    config = EngineConfig(
        model=ModelConfig(model_dir, dtype="float32"),
        cache=CacheConfig(num_kv_blocks=64),
        tensor_parallel_size=2,
    )
    engine = engine_core.EngineCore(config)
    assert isinstance(engine.runner, MultiprocExecutor)
    print("pids", os.getpid(), *engine.runner.worker_pids, flush=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    try:
        for i in range(10**9):
            engine.add_request(f"r{i}", [5, 6, 7, 8, 9], params)
            while engine.has_unfinished_requests():
                engine.step()
    except Exception as e:  # noqa: BLE001 -- as the engine loop: report, keep the process
        print(f"step failed: {type(e).__name__}", file=sys.stderr, flush=True)
        time.sleep(60)


if __name__ == "__main__":
    main(sys.argv[1])
