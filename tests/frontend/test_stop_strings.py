"""The stop-string matcher: finds stops across deltas and never leaks their beginnings."""

from __future__ import annotations

import pytest

from frontend_svc.stop_strings import StopStringMatcher

pytestmark = pytest.mark.timeout(10)


def run(stops: list[str], deltas: list[str], include: bool = False) -> tuple[str, str | None]:
    m = StopStringMatcher(stops, include)
    out = ""
    for i, d in enumerate(deltas):
        r = m.feed(d, final=i == len(deltas) - 1)
        out += r.text
        if r.stop is not None:
            return out, r.stop
    return out, None


def test_no_stops_passes_everything_through() -> None:
    assert run([], ["Hel", "lo"]) == ("Hello", None)


def test_stop_inside_one_delta_is_trimmed() -> None:
    assert run(["STOP"], ["abc STOP def"]) == ("abc ", "STOP")


def test_stop_spanning_deltas() -> None:
    assert run(["quick"], ["The", " qu", "ick", " brown"]) == ("The ", "quick")


def test_partial_stop_is_held_back_then_released() -> None:
    m = StopStringMatcher(["quick"])
    assert m.feed("The qu").text == "The "  # " qu" could start "quick"... "qu" is held
    assert m.feed("iet").text == "quiet"
    assert m.feed(" end", final=True).text == " end"


def test_earliest_of_several_stops_wins() -> None:
    assert run(["fox", "brown"], ["quick brown fox"]) == ("quick ", "brown")


def test_include_stop_in_output() -> None:
    assert run(["fox"], ["the f", "ox jumps"], include=True) == ("the fox", "fox")


def test_final_flushes_held_text() -> None:
    assert run(["quick"], ["a qu"]) == ("a qu", None)


@pytest.mark.parametrize("split", range(1, 11))
def test_every_split_point(split: int) -> None:
    text = "abcdSTOPef"
    out, stop = run(["STOP"], [text[:split], text[split:]])
    assert (out, stop) == ("abcd", "STOP")
