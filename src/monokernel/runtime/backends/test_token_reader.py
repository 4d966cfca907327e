import pytest

from monokernel.runtime.backends.base import CancelToken
from monokernel.runtime.backends.token_reader import CHECK_EVERY, read_tokens


def _drain(gen):  # type: ignore[no-untyped-def]
    """All yielded tokens and the generator's return value."""
    tokens = []
    while True:
        try:
            tokens.append(next(gen))
        except StopIteration as stop:
            return tokens, stop.value


def test_reads_published_tokens_until_done() -> None:
    out = [3, 1, 7, 8, 9]  # count 3, done
    assert _drain(read_tokens(out, None, lambda _s: None)) == ([7, 8, 9], True)


def test_tokens_published_while_polling_are_read_and_checks_run_when_idle() -> None:
    out = [0, 0, 0, 0]
    checks: list[float] = []

    def check(stalled: float) -> None:
        checks.append(stalled)
        if len(checks) == 1:  # the "kernel" publishes one token, then stops
            out[2], out[0] = 5, 1
        elif len(checks) == 2:
            out[3], out[0], out[1] = 6, 2, 1

    assert _drain(read_tokens(out, None, check)) == ([5, 6], True)
    assert len(checks) == 2 and all(s >= 0 for s in checks)


def test_cancel_ends_the_stream_without_done() -> None:
    cancel = CancelToken()
    out = [2, 0, 1, 2]
    gen = read_tokens(out, cancel, lambda _s: None)
    assert next(gen) == 1
    cancel.set()
    assert _drain(gen) == ([], False)


def test_a_failing_check_raises_to_the_consumer() -> None:
    def dead(_stalled: float) -> None:
        raise RuntimeError("the monokernel exited without finishing")

    with pytest.raises(RuntimeError, match="exited"):
        _drain(read_tokens([0, 0], None, dead))
    assert CHECK_EVERY > 1
