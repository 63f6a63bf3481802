"""Executors: how one engine step runs on the model's ranks. One rank runs the in-process
``ModelRunner``; more run ``MultiprocExecutor`` (tensor parallelism over worker processes)."""

from engine_svc.executor.multiproc import MultiprocExecutor, make_model_runner

__all__ = ["MultiprocExecutor", "make_model_runner"]
