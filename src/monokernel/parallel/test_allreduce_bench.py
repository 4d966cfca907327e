"""The in-kernel all-reduce: exact and identical on every GPU, never reset, never hangs (gpu);
the driver's size parsing, reference sum and table (CPU)."""

from __future__ import annotations

import argparse
import functools
import json
import math

import pytest
import torch

from monokernel.parallel import allreduce_bench as bench
from monokernel.testing.gpu_models import needs_hopper_pair

SIZES = [8, 2048, 4096, 6144, 8192, 16384, 32768, 65536]  # bytes


# ---- CPU -------------------------------------------------------------------------------------


def test_parse_sizes() -> None:
    assert bench.parse_sizes("2048, 4096,8192B") == [2048, 4096, 8192]
    for bad in ("0", "12", "-8"):
        with pytest.raises(argparse.ArgumentTypeError, match="multiple of 8"):
            bench.parse_sizes(bad)


def test_expected_sum_is_in_rank_order() -> None:
    # fp32: (1e8 + 1) - 1e8 == 0 but (1e8 - 1e8) + 1 == 1: the order is part of the contract.
    parts = [torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8])]
    assert float(bench.expected_sum(parts, 0)) == 0.0
    assert float(bench.expected_sum([parts[0], parts[2], parts[1]], 0)) == 1.0
    assert float(bench.expected_sum([torch.tensor([0.5])] * 2, 3)) == 7.0  # (0.5+3) * 2


def test_table_and_target_line() -> None:
    rows = [
        {"bytes": 2048, "in_kernel_us": 1.5, "in_kernel_event_us": 1.6},
        {"bytes": 4096, "in_kernel_us": 2.25, "in_kernel_event_us": 2.3, "nccl_graph_us": 8.0,
         "nccl_eager_us": 20.5, "ctas": 4},
    ]  # fmt: skip
    table = bench.format_table(rows)
    assert "| 4096 B | 2.25 | 8.00 | 20.50 | 2.30 |" in table
    assert "| 2048 B | 1.50 | n/a | n/a | 1.60 |" in table
    assert "met (2.25 µs)" in bench.target_line(rows, 2)
    assert "not measured" in bench.target_line(rows, 4)
    rows[1]["in_kernel_us"] = 3.5
    assert "MISSED" in bench.target_line(rows, 2)


def test_cli_refuses_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        bench._args(["--iters", "1"])
    with pytest.raises(SystemExit):
        bench._args(["--sizes", "100"])


# ---- GPU (2 Hopper GPUs with peer access) ---------------------------------------------------


@functools.lru_cache(maxsize=1)
def _group() -> bench.InKernelAllReduce:
    bench.multicast_off()
    return bench.InKernelAllReduce([0, 1], max(SIZES) // 4)


@pytest.mark.gpu
@needs_hopper_pair
@pytest.mark.parametrize("nbytes", SIZES)
def test_exact_and_identical_on_both_gpus(nbytes: int) -> None:
    bench.check_correct(_group(), nbytes // 4)  # raises on any differing value


@pytest.mark.gpu
@needs_hopper_pair
def test_many_launches_without_reset_and_sizes_interleaved() -> None:
    """Tags continue across launches and sizes; stale data from other layouts never counts."""
    g = _group()
    for k in range(20):
        n = (2048, 8192, 512)[k % 3]
        parts = bench.partials_for(g.devices, n, seed=k)
        iters = 1 + (k * 7) % 50
        res = g.run(parts, iters)
        want = bench.expected_sum(parts, iters - 1)
        assert all(torch.equal(o.cpu(), want) for o in res.outs), f"launch {k}"


@pytest.mark.gpu
@needs_hopper_pair
def test_timing_is_reported() -> None:
    res = _group().run(bench.partials_for([0, 1], 1024), 2000)
    assert all(0 < us < 100 for us in res.us_per_op), res.us_per_op
    print(f"4 KB: {res.us_per_op} µs per all-reduce (globaltimer), events {res.event_us_per_op}")


@pytest.mark.gpu
@needs_hopper_pair
def test_a_missing_peer_times_out_instead_of_hanging() -> None:
    """Only GPU 0 runs: it must give up after timeout_ms and say so, not spin forever."""
    from monokernel.kernels import allreduce as ar
    from monokernel.runtime.backends.monokernel.peer import DeviceBuffer, enable_peer_access

    enable_peer_access([0, 1])
    n = 1024
    bufs = [DeviceBuffer(d, ar.recv_buffer_bytes(2, n)) for d in (0, 1)]
    k = ar.AllReduceKernel(ar.build(), 0, 2, 128)
    dev = torch.device("cuda", 0)
    inp, out = torch.ones(n, device=dev), torch.empty(n, device=dev)
    timing = torch.zeros(2 * ar.grid_for(n, 128, 132), dtype=torch.int64, device=dev)
    err = torch.zeros(1, dtype=torch.int32, device=dev)
    p = ar.ArParams(
        inp=inp.data_ptr(), out=out.data_ptr(), timing=timing.data_ptr(), error=err.data_ptr(),
        rank=0, nranks=2, n=n, iters=3, base_tag=7, timeout_ms=100,
    )  # fmt: skip
    p.peer_recv[0], p.peer_recv[1] = bufs[0].ptr, bufs[1].ptr
    k.launch(ar.grid_for(n, 128, 132), p, torch.cuda.current_stream(dev).cuda_stream)
    torch.cuda.synchronize(dev)
    assert int(err.item()) == 1
    k.unload()
    for b in bufs:
        b.free()


@pytest.mark.gpu
@needs_hopper_pair
def test_cli_end_to_end_with_nccl(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ar.json"
    rc = bench.main(
        ["--sizes", "4096,8192", "--iters", "2000", "--reps", "3", "--nccl-reps", "200",
         "--graph-ops", "20", "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "| 4096 B |" in text and "target (4096 B at TP=2" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["bytes"] for r in rows] == [4096, 8192]
    assert all(math.isfinite(r["nccl_eager_us"]) for r in rows)
