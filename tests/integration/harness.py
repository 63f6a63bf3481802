"""Real engine and gateway subprocesses on loopback, for the integration tests.

Every process started here is recorded; ``kill_all`` (run by a session fixture and at exit)
kills whatever is still alive, so a failing test never leaves processes behind.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

API_KEY = "test-key"
MODEL = "tandem-tiny-llama"
_LIVE: list[Proc] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        TANDEM_CACHE_DIR=str(cache_dir),
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return env


class Proc:
    """One subprocess whose stdout is read line by line and whose stderr goes to a log file."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        log_dir: Path,
        new_session: bool = False,
    ) -> None:
        """``new_session``: the process leads a process group of its own (and its children
        join it), as under systemd or a shell's job control."""
        self.name = name
        self.log_path = log_dir / f"{name}-{time.monotonic_ns()}.log"
        self._log = self.log_path.open("wb")
        self.lines: list[str] = []
        self._ready_line = threading.Event()
        self.popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
            start_new_session=new_session,
        )
        _LIVE.append(self)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("TANDEM_ENGINE_READY"):
                self._ready_line.set()

    def log_tail(self, n: int = 3000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")

    def wait_line(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready_line.wait(0.05):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name} never became ready:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()
        try:
            self.popen.wait(10)
        finally:
            if self in _LIVE:
                _LIVE.remove(self)
            self._log.close()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds."""
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


class Engine(Proc):
    def __init__(
        self,
        cache_dir: Path,
        log_dir: Path,
        *flags: str,
        port: int | None = None,
        new_session: bool = False,
    ) -> None:
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "engine_svc", "--port", str(self.port), *flags]
        super().__init__("engine", argv, child_env(cache_dir), log_dir, new_session)

    def wait_ready(self, timeout: float = 60.0) -> Engine:
        self.wait_line(timeout)
        assert self.lines[-1] == f"TANDEM_ENGINE_READY {self.address}", self.lines
        return self


class Gateway(Proc):
    def __init__(self, engine_address: str, cache_dir: Path, log_dir: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            sys.executable,
            "-m",
            "frontend_svc",
            "--engine",
            engine_address,
            "--port",
            str(self.port),
            "--api-key",
            API_KEY,
            "--log-level",
            "warning",
            *flags,
        ]
        super().__init__("gateway", argv, child_env(cache_dir), log_dir)

    def wait_healthy(self, timeout: float = 60.0) -> Gateway:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                break
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"gateway never became healthy:\n{self.log_tail()}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}


def kill_all() -> None:
    for proc in list(_LIVE):
        proc.kill()


atexit.register(kill_all)
