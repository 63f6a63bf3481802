"""The contract's FlowControl rule (protos.flow_window), which the engine's Stream, the test fake
engine and the benchmark stand-in all use."""

from __future__ import annotations

from protos.flow_window import FlowWindow


def test_no_window_never_fills() -> None:
    w = FlowWindow()
    w.sent = 1000
    assert not w.full


def test_window_counts_unread_messages() -> None:
    w = FlowWindow()
    w.flow(2, 0)
    w.sent = 2
    assert w.full
    w.flow(0, 1)  # a window of 0 keeps the one set; one message read
    assert w.window == 2 and w.read == 1 and not w.full
    w.sent = 3
    assert w.full


def test_reported_reads_only_grow_and_never_pass_what_was_sent() -> None:
    w = FlowWindow()
    w.flow(4, 10)
    assert w.read == 0  # nothing sent yet
    w.sent = 3
    w.flow(0, 2)
    w.flow(0, 1)  # a late, smaller report
    assert w.read == 2


def test_a_dropped_window_stays_dropped() -> None:
    w = FlowWindow()
    w.flow(1, 0)
    w.sent = 5
    w.drop()
    assert not w.full
    w.flow(1, 0)
    assert w.window == 0 and not w.full
