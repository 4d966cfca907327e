import pytest

from monokernel.runtime.backends.base import CancelToken
from monokernel.runtime.backends.monokernel.token_reader import CHECK_EVERY, read_tokens


def _drain(gen):  # type: ignore[no-untyped-def]
    """All yielded tokens and the generator's return value."""
    tokens = []
    while True:
        try:
            tokens.append(next(gen))
        except StopIteration as stop:
            return tokens, stop.value


def test_reads_published_tokens_until_done() -> None:
    out = [3, 1, 8, 1, 10, 0]  # count 3, done; tokens 7, 0, 9 stored as id + 1
    assert _drain(read_tokens(out, None, lambda _s: None)) == ([7, 0, 9], True)


def test_tokens_published_while_polling_are_read_and_checks_run_when_idle() -> None:
    out = [0, 0, 0, 0, 0]
    checks: list[float] = []

    def check(stalled: float) -> None:
        checks.append(stalled)
        if len(checks) == 1:  # the "kernel" publishes one token, then stops
            out[2], out[0] = 6, 1
        elif len(checks) == 2:
            out[3], out[0], out[1] = 7, 2, 1

    assert _drain(read_tokens(out, None, check)) == ([5, 6], True)
    assert len(checks) == 2 and all(s >= 0 for s in checks)


def test_a_token_word_seen_after_the_done_flag_is_still_read() -> None:
    """The reader may pass the last token's word just before it lands and see `done` (which
    the kernel fences after every token) on its next look: it reads the word again."""
    out = [0, 0, 4, 0, 0]
    reads = {"done": 0}

    class Words(list):
        def __getitem__(self, i):  # type: ignore[no-untyped-def]
            if i == 1 and super().__getitem__(1) == 0:
                reads["done"] += 1
                super().__setitem__(3, 9)  # token 8 lands, then done
                super().__setitem__(1, 1)
                return 1
            return super().__getitem__(i)

    assert _drain(read_tokens(Words(out), None, lambda _s: None)) == ([3, 8], True)
    assert reads["done"] == 1


def test_cancel_ends_the_stream_without_done() -> None:
    cancel = CancelToken()
    out = [2, 0, 2, 3, 0]
    gen = read_tokens(out, cancel, lambda _s: None)
    assert next(gen) == 1
    cancel.set()
    assert _drain(gen) == ([], False)


def test_a_failing_check_raises_to_the_consumer() -> None:
    def dead(_stalled: float) -> None:
        raise RuntimeError("the monokernel exited without finishing")

    with pytest.raises(RuntimeError, match="exited"):
        _drain(read_tokens([0, 0, 0], None, dead))
    assert CHECK_EVERY > 1


def test_masks_go_out_a_step_ahead_and_logprobs_before_each_token() -> None:
    """request.py's wrappers of the token stream: step s + 1's grammar mask is published
    when token s lands (none past the last step), each step's logprobs record is read before
    its token is yielded, and the kernel's finished flag comes through both."""
    from monokernel.runtime.backends.monokernel.request import masks_ahead, with_logprobs

    events: list[tuple[str, int]] = []

    class Matcher:
        def advance(self, token: int) -> None:
            events.append(("advance", token))

        def words(self) -> str:
            return "w"

    class Grammar:  # one a TP rank: each gets every mask
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def publish(self, step: int, words: str) -> None:
            events.append((f"publish{self.rank}", step))

    class Rules:
        def logprobs(self, step: int, n: int) -> str:
            events.append(("logprobs", step))
            return f"lp{step}"

    sink: list[str] = []
    out = [3, 1, 8, 1, 10, 0]  # tokens 7, 0, 9, then done
    grammars = (Grammar(0), Grammar(1))
    masked = masks_ahead(read_tokens(out, None, lambda _s: None), Matcher(), grammars, 3)  # type: ignore[arg-type]
    gen = with_logprobs(masked, Rules(), 2, sink)  # type: ignore[arg-type]
    assert _drain(gen) == ([7, 0, 9], True)
    assert sink == ["lp0", "lp1", "lp2"]
    assert events == [
        ("advance", 7), ("publish0", 1), ("publish1", 1), ("logprobs", 0),
        ("advance", 0), ("publish0", 2), ("publish1", 2), ("logprobs", 1),
        ("advance", 9), ("logprobs", 2),
    ]  # fmt: skip


def test_begin_masks_and_kernel_tokens_for_one_kernel_or_several() -> None:
    """request.py's launch helpers, as the one-GPU driver and the TP backend call them: the
    first tag is the kernels' common one with step 0's mask on each (tags that disagree are
    an error), and kernel_tokens adds the masks and the logprobs only where asked."""
    from monokernel.runtime.backends.monokernel.request import begin_masks, kernel_tokens
    from monokernel.runtime.sampling import SamplingParams

    events: list[tuple[str, int]] = []

    class Grammar:
        def __init__(self, name: str, tag: int) -> None:
            self.name, self.tag = name, tag

        def begin(self, steps: int) -> int:
            events.append((f"begin{self.name}", steps))
            return self.tag

        def publish(self, step: int, words: str) -> None:
            events.append((f"publish{self.name}", step))

    class Matcher:
        def advance(self, token: int) -> None:
            events.append(("advance", token))

        def words(self) -> str:
            return "w"

    class Rules:
        def logprobs(self, step: int, n: int) -> str:
            return f"lp{step}x{n}"

    ranks = (Grammar("0", 5), Grammar("1", 5))
    assert begin_masks(ranks, Matcher(), 3) == 5  # type: ignore[arg-type]
    assert events == [("begin0", 3), ("begin1", 3), ("publish0", 0), ("publish1", 0)]
    with pytest.raises(RuntimeError, match="disagree"):
        begin_masks((Grammar("0", 5), Grammar("1", 6)), Matcher(), 3)  # type: ignore[arg-type]

    def landed():  # type: ignore[no-untyped-def]
        return read_tokens([3, 1, 8, 1, 10, 0], None, lambda _s: None)  # 7, 0, 9, done

    plain = SamplingParams()
    events.clear()
    sink: list[str] = []
    gen = kernel_tokens(landed(), 3, None, (), Rules(), plain, sink)  # type: ignore[arg-type]
    assert _drain(gen) == ([7, 0, 9], True) and sink == [] and events == []
    asked = SamplingParams(logprobs=2)
    gen = kernel_tokens(landed(), 3, Matcher(), ranks, Rules(), asked, sink)  # type: ignore[arg-type]
    assert _drain(gen) == ([7, 0, 9], True)
    assert sink == ["lp0x2", "lp1x2", "lp2x2"]
    assert events[:3] == [("advance", 7), ("publish0", 1), ("publish1", 1)]
    gen = kernel_tokens(landed(), 3, None, (), Rules(), asked, None)  # type: ignore[arg-type]
    assert _drain(gen) == ([7, 0, 9], True)  # no sink: no records asked for
