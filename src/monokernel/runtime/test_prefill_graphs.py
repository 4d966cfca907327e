import pytest
import torch

from monokernel.runtime.prefill_graphs import (
    MAX_SUFFIX_BUCKET,
    MIN_BUCKET,
    PrefillGraphs,
    bucket_for,
    graph_keys,
    graphs_enabled,
    keys_bucket,
)


@pytest.mark.parametrize(
    ("tokens", "largest", "want"),
    [(1, 2048, MIN_BUCKET), (16, 2048, 16), (17, 2048, 32), (1000, 2048, 1024),
     (1025, 2048, 2048), (2048, 2048, 2048), (2049, 2048, None), (600, 1000, 1000),
     (1001, 1000, None), (5, 10, 10), (0, 2048, None)],
)  # fmt: skip
def test_bucket_is_the_next_power_of_two_or_the_cap(
    tokens: int, largest: int, want: int | None
) -> None:
    assert bucket_for(tokens, largest) == want


def test_graphs_only_on_cuda_and_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not graphs_enabled(torch.device("cpu"))
    monkeypatch.setenv("MONOKERNEL_PREFILL_GRAPHS", "0")
    assert not graphs_enabled(torch.device("cuda", 0))
    monkeypatch.setenv("MONOKERNEL_PREFILL_GRAPHS", "1")
    assert graphs_enabled(torch.device("cuda", 0))


def test_keys_bucket_covers_the_end_and_stays_in_the_cache() -> None:
    assert keys_bucket(1, 4096) == MIN_BUCKET
    assert keys_bucket(2012, 4096) == 2048
    assert keys_bucket(2049, 4096) == 4096
    assert keys_bucket(16884, 16949) == 16949  # capped: the cache's own length


@pytest.mark.parametrize(
    ("largest", "max_len"), [(512, 1024), (2048, 8192), (2048, 16949), (1000, 1000)]
)
def test_graph_keys_cover_every_replay_and_nothing_else(largest: int, max_len: int) -> None:
    """Every (bucket, key rows) PrefillGraphs.run asks for, over every prompt length and start
    that fits, is among graph_keys, and each of graph_keys is asked for by some request."""
    fresh = {bucket_for(t, largest) for t in range(1, largest + 1)}
    cap = min(largest, MAX_SUFFIX_BUCKET)
    suffix = {bucket_for(t, cap) for t in range(1, cap + 1)}
    want = {(b, 0) for b in fresh}
    for start in range(1, max_len):
        for b in suffix:
            if b is not None and start + b <= max_len:
                want.add((b, keys_bucket(start + b, max_len)))
    got = graph_keys(largest, max_len)
    assert len(got) == len(set(got)) and set(got) == want
    if max_len == 8192:
        assert len(got) == 8 + 42  # buckets 16..2048 fresh; 16..1024 at each key bucket


def test_a_turn_near_the_cache_end_starts_earlier_to_stay_graphed() -> None:
    g = PrefillGraphs(lambda t: t, lambda t, p, k: t, largest=2048, max_len=8192)
    assert g.fitting_start(100, 50) == 100  # bucket 64 fits
    assert g.fitting_start(7809, 321) == 8192 - 512  # bucket 512 would end at 8321
    at = g.fitting_start(7809, 321)
    assert at + bucket_for(7809 + 321 - at, MAX_SUFFIX_BUCKET) <= 8192  # type: ignore[operator]
    assert g.fitting_start(6000, 1500) == 6000  # past the suffix buckets: eager anyway
    assert g.fitting_start(0, 5000) == 0  # past the chunk: chunked, eager
