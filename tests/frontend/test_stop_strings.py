"""The stop-string matcher: finds stops across deltas and never leaks their beginnings."""

from __future__ import annotations

import pytest

from frontend_svc.text.stop_strings import StopMatch, StopStringMatcher

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


def test_unarmed_text_is_emitted_and_never_stops() -> None:
    m = StopStringMatcher(["e"])
    assert m.feed("Hello", armed=False) == StopMatch("Hello")
    assert m.feed(" The", armed=False) == StopMatch(" The")
    assert m.feed(" quick") == StopMatch(" quick")
    assert m.feed(" over") == StopMatch(" ov", "e")


def test_stop_spanning_the_arming_point_is_found_in_held_back_text() -> None:
    m = StopStringMatcher(["! The"])
    assert m.feed("Hello world!", armed=False) == StopMatch("Hello world")  # "!" held
    assert m.feed(" The") == StopMatch("", "! The")


def test_stop_spanning_the_arming_point_with_include() -> None:
    m = StopStringMatcher(["! The"], include_stop_in_output=True)
    assert m.feed("Hello world!", armed=False) == StopMatch("Hello world")
    assert m.feed(" The end") == StopMatch("! The", "! The")


def test_stop_complete_before_arming_does_not_fire_later() -> None:
    # "wor" is complete in unarmed text that is held back (it may start "world! Zzz").
    m = StopStringMatcher(["wor", "world! Zzz"])
    assert m.feed("Hello world!", armed=False) == StopMatch("Hello ")
    assert m.feed(" The") == StopMatch("world! The")
    assert m.feed(" wor") == StopMatch(" ", "wor")  # a new one, in armed text, does


def test_overlapping_stop_across_the_arming_point() -> None:
    # vLLM: text "eee" with the third "e" armed finds "ee" at 1 (ending in armed text).
    m = StopStringMatcher(["ee"])
    assert m.feed("ee", armed=False) == StopMatch("e")
    assert m.feed("e") == StopMatch("", "ee")


def test_unarmed_final_flushes_everything() -> None:
    m = StopStringMatcher(["quick"])
    assert m.feed("a qu", armed=False) == StopMatch("a ")
    assert m.feed("", final=True, armed=False) == StopMatch("qu")
