"""The SM-speed deal: proportional shares (CPU), the probe kernel's build and ctypes mirror
(nvcc, no GPU), and a measurement on the GPU (marker ``gpu``)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from monokernel.kernels import sm_shares
from monokernel.kernels.build import ARCH_FLAGS, find_nvcc

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


@pytest.mark.parametrize(
    ("total", "weights"),
    [(151936, [1.0] * 108 + [1.145] * 24), (1003, [1.0, 2.0, 3.0]), (5, [1.0] * 7), (0, [1.0])],
)
def test_deal_is_contiguous_proportional_and_complete(total: int, weights: list[float]) -> None:
    out = sm_shares.deal(total, weights)
    assert len(out) == len(weights)
    assert sum(c for _, c in out) == total
    first = 0
    for (f, c), w in zip(out, weights, strict=True):
        assert f == first and c >= 0
        assert abs(c - total * w / sum(weights)) < 1.0  # largest remainder: within one item
        first += c


def test_faster_sms_get_more_rows() -> None:
    out = sm_shares.deal(1000, [2.0, 1.0, 1.0])
    assert out == [(0, 500), (500, 250), (750, 250)]


@pytest.mark.parametrize("weights", [[], [1.0, 0.0], [1.0, -2.0], [float("nan")]])
def test_deal_refuses_bad_weights(weights: list[float]) -> None:
    with pytest.raises(ValueError, match="positive weights"):
        sm_shares.deal(10, weights)


def test_share_table_by_sm_id() -> None:
    times = {0: 18.5, 1: 18.5, 3: 16.2}  # id 2 not measured: no rows
    table = sm_shares.share_table(times, (1003, 10))
    assert table.shape == (2 * 4, 2) and table.dtype == torch.int32
    for k, total in enumerate((1003, 10)):
        block = table[4 * k : 4 * (k + 1)]
        assert int(block[:, 1].sum()) == total and int(block[2, 1]) == 0
        assert int(block[3, 1]) >= int(block[0, 1])  # the faster SM
        # Each measured SM's rows follow the previous one's, from 0.
        ends = [int(block[i, 0]) + int(block[i, 1]) for i in (0, 1)]
        assert int(block[0, 0]) == 0 and int(block[1, 0]) == ends[0]
        assert int(block[3, 0]) == ends[1]
    with pytest.raises(ValueError, match="no SM"):
        sm_shares.share_table({}, (10,))


@needs_nvcc
def test_probe_builds_and_its_params_match(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MONOKERNEL_CACHE", str(tmp_path))
    path = sm_shares.build()
    assert path.read_bytes()[:4] == b"\x7fELF" and sm_shares.build() == path
    checks = [
        f'static_assert(sizeof(SpeedParams) == {ctypes.sizeof(sm_shares.SpeedParams)}, "size");'
    ]
    for name, *_ in sm_shares.SpeedParams._fields_:
        off = getattr(sm_shares.SpeedParams, name).offset
        checks.append(f'static_assert(offsetof(SpeedParams, {name}) == {off}, "{name}");')
    src = tmp_path / "layout.cu"
    src.write_text(
        "#include <cstddef>\n"
        + sm_shares.SOURCE.read_text().split("__device__", 1)[0]  # the includes and the struct
        + "\n".join(checks)
        + "\n"
    )
    cmd = [find_nvcc(), *ARCH_FLAGS, "-c", "-o", str(tmp_path / "l.o"), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs a Hopper GPU (sm_90)",
)
def test_measure_times_every_sm() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    grid = torch.cuda.get_device_properties(dev).multi_processor_count
    times = sm_shares.measure(dev, grid)
    assert len(times) == grid
    assert all(0 < t < 1e4 for t in times.values())
    slow, fast = max(times.values()), min(times.values())
    print(f"SM streaming times: {fast:.2f}..{slow:.2f} µs for 256 KB each, all SMs at once")
