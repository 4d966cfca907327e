"""The GPUs' exchange of the sharded prefill (prefill_exchange.py) against the host's sum:
every rank ends with the bits of x + partial 0 + ... + partial N-1 (+ the bias) in that
order, over hidden sizes a multiple of 4 and not, exchange after exchange (the buffers
alternate and the signal counts carry on)."""

from __future__ import annotations

import pytest
import torch

from monokernel.runtime.prefill_exchange import ATTENTION, MLP, PeerExchange
from monokernel.testing.gpu_models import hopper_gpus


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [96, 90, 1536])
@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_every_rank_sums_the_partials_in_rank_order(nranks: int, hidden: int) -> None:
    if not hopper_gpus(nranks):
        pytest.skip(f"needs {nranks} Hopper GPU(s) with peer access")
    devices = [torch.device(f"cuda:{r}") for r in range(nranks)]
    rows = 37
    ex = PeerExchange(devices, rows, hidden)
    try:
        g = torch.Generator().manual_seed(hidden + nranks)
        bias = torch.randn(hidden, generator=g)
        for step in range(6):
            which = (ATTENTION, MLP)[step % 2]
            t = rows - 5 * step  # fewer rows than the buffers hold, too
            x = torch.randn(t, hidden, generator=g)
            parts = [torch.randn(t, hidden, generator=g) for _ in devices]
            want = x.clone()
            for p in parts:
                want += p
            if which == ATTENTION:
                want += bias
            xs = [x.to(d) for d in devices]
            for r, d in enumerate(devices):
                ex.partial(r, which, t).copy_(parts[r].to(d))
            ex.reduce_all(xs, which, bias if which == ATTENTION else None)
            for r in range(nranks):
                assert torch.equal(xs[r].cpu(), want), (step, r)
    finally:
        ex.free()


@pytest.mark.gpu
def test_refuses_what_it_cannot_hold() -> None:
    if not hopper_gpus(1):
        pytest.skip("needs a Hopper GPU")
    ex = PeerExchange([torch.device("cuda:0")], 8, 64)
    try:
        with pytest.raises(ValueError, match="1 to 8"):
            ex.partial(0, MLP, 9)
        with pytest.raises(ValueError, match="fp32"):
            ex.reduce_rank(0, torch.zeros(4, 64, device="cuda:0", dtype=torch.bfloat16), MLP)
    finally:
        ex.free()
