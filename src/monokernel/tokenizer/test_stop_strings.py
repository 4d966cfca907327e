from __future__ import annotations

from monokernel.tokenizer.stop_strings import StopStringMatcher


def _run(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    m = StopStringMatcher(stops)
    out = ""
    for d in deltas:
        out += m.feed(d)
        if m.stopped:
            return out, True
    return out + m.flush(), False


def test_cut_before_a_stop_within_one_delta() -> None:
    assert _run(["END"], ["hello END world"]) == ("hello ", True)


def test_stop_split_across_deltas_is_held_back_then_cut() -> None:
    m = StopStringMatcher(["\n\n"])
    assert m.feed("a\n") == "a"  # "\n" might start the stop
    assert m.feed("\nb") == ""
    assert m.stopped


def test_held_back_prefix_is_released_when_no_stop_follows() -> None:
    assert _run(["STOP"], ["x ST", "ay"]) == ("x STay", False)
    assert _run(["STOP"], ["x ST"]) == ("x ST", False)


def test_earliest_of_several_stops_wins() -> None:
    assert _run(["b", "cd"], ["a", "cdb"]) == ("a", True)


def test_no_stops_passes_everything() -> None:
    assert _run([], ["a", "b"]) == ("ab", False)
