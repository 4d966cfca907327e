import pytest
import torch

from monokernel.runtime.prefill_graphs import MIN_BUCKET, bucket_for, graphs_enabled, keys_bucket


@pytest.mark.parametrize(
    ("tokens", "largest", "want"),
    [(1, 2048, MIN_BUCKET), (16, 2048, 16), (17, 2048, 32), (1000, 2048, 1024),
     (1025, 2048, 2048), (2048, 2048, 2048), (2049, 2048, None), (600, 1000, None),
     (0, 2048, None)],
)  # fmt: skip
def test_bucket_is_the_next_power_of_two(tokens: int, largest: int, want: int | None) -> None:
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
