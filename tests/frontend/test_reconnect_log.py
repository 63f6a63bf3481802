"""An engine that is away for long is logged in a few lines, not one per reconnection attempt:
the first failure, a count at growing intervals, and one line when connected."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from frontend_svc.config import BackoffConfig
from frontend_svc.engine.client import EngineClient
from frontend_svc.engine.reconnect_log import ReconnectLog
from tests.frontend.conftest import make_engine
from tests.frontend.harness import free_port

pytestmark = pytest.mark.timeout(30)

ADDRESS = "10.0.0.1:50051"
REFUSED = "UNAVAILABLE: Connection refused"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records]


def test_an_engine_loading_for_15_minutes_is_a_few_lines(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = ReconnectLog(ADDRESS, logging.getLogger("test.reconnect"), clock)
    caplog.set_level(logging.DEBUG, "test.reconnect")
    attempts = 0
    while clock.now < 100.0 + 15 * 60:  # one attempt every 0.5 s, as the client makes them
        log.failed(REFUSED)
        attempts += 1
        clock.now += 0.5
    log.connected("qwen")
    got = lines(caplog)
    assert attempts == 1800
    assert got[0] == (
        logging.WARNING,
        f"engine {ADDRESS} unavailable ({REFUSED}); retrying, next report in 5.0 s",
    )
    summaries = [m for _, m in got[1:-1]]
    assert [m.split(" in ")[1].split(" (")[0] for m in summaries] == [
        "5.0 s",
        "30.0 s",
        "1.0 min",
        "2.0 min",
        "5.0 min",
        "10.0 min",
    ]
    assert summaries[0] == (
        f"engine {ADDRESS} still unavailable after 11 attempts in 5.0 s (last: {REFUSED}); retrying"
    )
    assert all(level == logging.WARNING for level, _ in got[:-1])
    assert got[-1] == (
        logging.INFO,
        f"connected to engine {ADDRESS} (qwen) after 1800 failed attempts in 15.0 min",
    )


def test_a_broken_stream_is_said_at_once_and_counts_its_retries(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    log = ReconnectLog(ADDRESS, logging.getLogger("test.reconnect"), clock)
    caplog.set_level(logging.DEBUG, "test.reconnect")
    log.connected("m")  # at the first attempt: no count
    log.broke("the engine closed the stream")
    for _ in range(4):
        clock.now += 0.5
        log.failed(REFUSED)
    log.connected("m")
    log.broke("UNAVAILABLE: gone")
    log.connected("m")  # back at the first try
    assert lines(caplog) == [
        (logging.INFO, f"connected to engine {ADDRESS} (m)"),
        (logging.WARNING, f"engine stream to {ADDRESS} broke: the engine closed the stream"),
        (logging.INFO, f"connected to engine {ADDRESS} (m) after 4 failed attempts in 2.0 s"),
        (logging.WARNING, f"engine stream to {ADDRESS} broke: UNAVAILABLE: gone"),
        (logging.INFO, f"connected to engine {ADDRESS} (m)"),
    ]


def test_an_unexpected_error_is_logged_in_full_once_per_kind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    log = ReconnectLog(ADDRESS, logging.getLogger("test.reconnect"), clock)
    caplog.set_level(logging.DEBUG, "test.reconnect")
    log.failed(REFUSED)
    mismatch = ValueError("engine serves another model")
    for _ in range(3):
        clock.now += 0.5
        log.failed(repr(mismatch), mismatch)
    records = caplog.records
    assert len(records) == 2
    assert records[1].exc_info is not None and records[1].exc_info[1] is mismatch
    assert "connecting failed (ValueError('engine serves another model'))" in records[1].message


def test_a_missed_summary_time_is_one_line_not_a_burst(caplog: pytest.LogCaptureFixture) -> None:
    """Attempts that each take long (an rpc timeout) may pass several summary times at once."""
    clock = Clock()
    log = ReconnectLog(ADDRESS, logging.getLogger("test.reconnect"), clock)
    caplog.set_level(logging.DEBUG, "test.reconnect")
    log.failed(REFUSED)
    clock.now += 100  # past 5, 30 and 60 s
    log.failed(REFUSED)
    clock.now += 1
    log.failed(REFUSED)  # the next is due at 120 s
    clock.now += 20
    log.failed(REFUSED)
    assert [m.split(" after ")[-1].split(" (")[0] for _, m in lines(caplog)[1:]] == [
        "2 attempts in 1.7 min",
        "4 attempts in 2.0 min",
    ]


def test_a_client_waiting_for_its_engine_logs_once_then_once_when_connected(
    tokenizer_dir: Path, hf_tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    """The real client, retrying every 20 ms against a closed port for a second (~50 attempts),
    then the engine comes up on it."""
    port = free_port()
    engine = make_engine(tokenizer_dir, hf_tokenizer)
    caplog.set_level(logging.INFO, "frontend_svc.engine.client")

    async def scenario() -> None:
        client = EngineClient(f"127.0.0.1:{port}", BackoffConfig(0.01, 0.02))
        client.start()
        try:
            assert not await client.wait_connected(1.0)
            await asyncio.to_thread(engine.start, port)
            assert await client.wait_connected(10)
        finally:
            await client.close()

    try:
        asyncio.run(scenario())
    finally:
        engine.stop()
    got = [(r.levelno, r.getMessage()) for r in caplog.records if r.name.endswith("client")]
    assert len(got) == 2, got
    assert got[0][0] == logging.WARNING
    assert got[0][1].startswith(f"engine 127.0.0.1:{port} unavailable (UNAVAILABLE: ")
    level, message = got[1]
    assert level == logging.INFO
    assert message.startswith(f"connected to engine 127.0.0.1:{port} (tiny-fake) after ")
    failed = int(message.split(" after ")[1].split()[0])
    assert failed >= 10  # every attempt was made; only their log lines were not
