"""Prefix reuse bookkeeping, no device: matching, what the cache holds after a run (also a
cancelled one), snapshots under a byte budget."""

from __future__ import annotations

from monokernel.runtime.prefix_cache import PrefixCache, common_prefix, fed_tokens

BPT = 10  # bytes per token in these tests


def _cache(budget_tokens: int = 0, min_tokens: int = 4) -> PrefixCache:
    return PrefixCache(BPT, budget_tokens * BPT, min_snapshot_tokens=min_tokens)


def _run(pc: PrefixCache, prompt: list[int], generated: list[int], steps: int | None = None):
    """What the backend does for one request: plan, prefill, decode ``steps`` steps."""
    plan = pc.plan(prompt)
    pc.begin(prompt, plan.reuse)
    pc.written(prompt[:-1])
    steps = len(generated) if steps is None else steps
    pc.finish(prompt, fed_tokens(prompt, generated, steps))
    return plan


def test_common_prefix() -> None:
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix((5,), [5]) == 1
    long = list(range(5000))
    for k in (0, 1023, 1024, 1025, 4999):  # around the block size of the fast path
        assert common_prefix(long, (*long[:k], -1)) == k
    assert common_prefix(long, tuple(long)) == 5000


def test_fed_tokens_are_what_the_kernel_wrote() -> None:
    prompt = [1, 2, 3]
    assert fed_tokens(prompt, [7, 8, 9], 3) == [3, 7, 8]  # the last output is never fed
    assert fed_tokens(prompt, [7, 8, 9], 0) == []
    assert fed_tokens(prompt, [7, 8, 9], 1) == [3]
    assert fed_tokens(prompt, [], 2, forced=[3, 5, 6]) == [3, 5]


def test_live_cache_after_a_request_holds_prompt_and_fed_tokens() -> None:
    pc = _cache()
    _run(pc, [1, 2, 3, 4], [10, 11, 12])
    assert pc.live == (1, 2, 3, 4, 10, 11)


def test_longest_common_prefix_and_one_token_left() -> None:
    pc = _cache()
    assert pc.plan([1, 2, 3]).reuse == 0  # nothing cached yet
    _run(pc, [1, 2, 3, 4], [10, 11, 12])  # live: 1 2 3 4 10 11
    assert pc.plan([1, 2, 3, 4, 10, 11, 12, 13]).reuse == 6  # the conversation goes on
    assert pc.plan([1, 2, 9, 9]).reuse == 2  # diverges after two tokens
    assert pc.plan([1, 2, 3, 4]).reuse == 3  # same prompt: the last token is recomputed
    assert pc.plan([1, 2]).reuse == 1  # a shorter prompt inside the cache
    assert pc.plan([1]).reuse == 0
    assert pc.plan([9, 1, 2]).reuse == 0


def test_reuse_off_plans_nothing() -> None:
    pc = _cache(budget_tokens=100)
    _run(pc, [1, 2, 3, 4], [10, 11])
    pc.enabled = False
    plan = pc.plan([1, 2, 3, 4, 10, 99])
    assert plan.reuse == 0 and plan.restore is None and plan.save == ()


def test_a_new_request_invalidates_what_it_overwrites() -> None:
    pc = _cache()
    _run(pc, [1, 2, 3, 4, 5], [10, 11])  # live: 1 2 3 4 5 10
    plan = pc.plan([1, 2, 7, 8])
    pc.begin([1, 2, 7, 8], plan.reuse)
    assert pc.live == (1, 2)  # positions >= 2 are about to be overwritten
    pc.written([1, 2, 7])
    assert pc.live == (1, 2, 7)
    pc.invalidate()  # a failed run: nothing is trusted
    assert pc.live == () and pc.plan([1, 2, 7, 8]).reuse == 0


def test_cancel_mid_request_keeps_only_the_written_positions() -> None:
    """The consumer took 2 tokens and cancelled, but the kernel completed 4 steps (it runs
    ahead of the host): steps 0..3 wrote the last prompt token and the first 3 outputs."""
    pc = _cache()
    generated = [10, 11, 12, 13]  # what the kernel produced before it saw the cancel word
    _run(pc, [1, 2, 3], generated, steps=4)
    assert pc.live == (1, 2, 3, 10, 11, 12)
    _run(pc, [1, 2, 3], [20], steps=0)  # cancelled before the first step finished
    assert pc.live == (1, 2)


def test_snapshot_saved_when_diverging_and_restored_later() -> None:
    pc = _cache(budget_tokens=100, min_tokens=4)
    a = list(range(1, 21))  # conversation A: 20 tokens
    _run(pc, a, [50, 51, 52])  # live: A + 50 51
    b = [1, 2, 3, 99, 98, 97]  # B shares 3 tokens with A
    plan = _run(pc, b, [60])
    assert plan.reuse == 3 and plan.restore is None
    assert plan.save == (*a, 50, 51)  # A's cache is kept before B overwrites it
    pc.add_snapshot(plan.save, payload="A")
    a2 = [*a, 50, 51, 52, 70, 71]  # A continues
    plan = pc.plan(a2)
    assert plan.restore is not None and plan.restore.payload == "A"
    assert (plan.restore_from, plan.reuse) == (3, 22)  # [0, 3) already live; copy [3, 22)
    assert plan.save == ()  # B lost only 3 tokens: below min_snapshot_tokens


def test_no_snapshot_without_budget_or_when_little_is_lost() -> None:
    pc = _cache(budget_tokens=0)
    _run(pc, list(range(1, 21)), [5, 6])
    assert pc.plan([1, 2, 9]).save == ()
    pc = _cache(budget_tokens=100, min_tokens=8)
    _run(pc, list(range(1, 11)), [5, 6])  # live: 1..10, 5
    assert pc.plan([*range(1, 5), 9]).save == ()  # 7 tokens lost < 8
    assert pc.plan([1, 9]).save == (*range(1, 11), 5)  # 10 lost


def test_snapshot_truncated_to_the_budget() -> None:
    pc = _cache(budget_tokens=8, min_tokens=4)
    _run(pc, list(range(1, 21)), [5])
    assert pc.plan([1, 99]).save == tuple(range(1, 9))
    assert pc.plan([*range(1, 6), 99]).save == ()  # the 8 that fit mostly survive anyway


def test_lru_eviction_by_budget() -> None:
    pc = _cache(budget_tokens=25)
    s1 = pc.add_snapshot(range(100, 110), "s1")
    s2 = pc.add_snapshot(range(200, 210), "s2")
    assert s1 and s2 and pc.used_bytes == 20 * BPT
    pc.touch(s1)  # s2 is now least recently used
    s3 = pc.add_snapshot(range(300, 310), "s3")
    assert s3 and [s.payload for s in pc.snapshots] == ["s3", "s1"]
    assert pc.used_bytes <= pc.budget_bytes
    assert pc.add_snapshot(range(26), "too big") is None
    assert [s.payload for s in pc.snapshots] == ["s3", "s1"]


def test_eviction_never_takes_the_snapshot_being_restored() -> None:
    pc = _cache(budget_tokens=20)
    keep = pc.add_snapshot(range(100, 110), "keep")
    pc.add_snapshot(range(200, 210), "other")
    pc.touch(pc.snapshots[1])  # "keep" is least recently used
    assert pc.add_snapshot(range(300, 310), "new", keep=keep) is not None
    assert {s.payload for s in pc.snapshots} == {"keep", "new"}
    assert pc.add_snapshot(range(400, 415), "no room beside keep", keep=keep) is None


def test_a_longer_snapshot_supersedes_its_prefix_and_covered_ones_are_not_saved() -> None:
    pc = _cache(budget_tokens=100, min_tokens=2)
    pc.add_snapshot([1, 2, 3], "short")
    pc.add_snapshot([1, 2, 3, 4, 5], "long")
    assert [s.payload for s in pc.snapshots] == ["long"]
    pc.written([1, 2, 3, 4])  # the live cache holds a prefix of "long"
    assert pc.plan([1, 9, 9]).save == ()  # nothing new to save


def test_best_of_several_snapshots_wins() -> None:
    pc = _cache(budget_tokens=100)
    pc.add_snapshot([1, 2, 3, 4], "four")
    pc.add_snapshot([1, 2, 9, 9, 9, 9], "two")  # more recent, shorter match
    plan = pc.plan([1, 2, 3, 4, 7, 7])
    assert plan.restore is not None and plan.restore.payload == "four" and plan.reuse == 4
    pc.clear()
    assert pc.snapshots == () and pc.live == ()
