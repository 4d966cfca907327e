"""The build's two specialisations (with and without group units) and the context rule that
picks between them; the compile of the lighter one needs only nvcc."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import pytest

from monokernel.bench.shapes import SHAPES
from monokernel.kernels import build as kbuild


def test_build_without_group_units_is_its_own_cubin() -> None:
    dims = kbuild.KernelDims.from_config(SHAPES["llama-3.2-1b"])
    short = dataclasses.replace(dims, group_units=False)
    assert "-DMK_ATTN_GROUP=0" in short.defines()
    assert not any(d.startswith("-DMK_ATTN_GROUP") for d in dims.defines())
    assert kbuild.cubin_path(dims) != kbuild.cubin_path(short)


def test_head_units_cover_contexts_whose_ranges_fit_the_grid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MONOKERNEL_NVCC_FLAGS", raising=False)
    dims = kbuild.KernelDims.from_config(SHAPES["llama-3.2-1b"])
    assert dims.built_attn_chunk() == dims.attn_chunk() == 512
    splits = 132 // 32  # H100 SMs // heads
    assert dims.head_units_cover(1, splits)
    assert dims.head_units_cover(512 * splits, splits)
    assert not dims.head_units_cover(512 * splits + 1, splits)
    assert not dims.head_units_cover(1, 0)  # more heads than SMs: group units only
    monkeypatch.setenv("MONOKERNEL_NVCC_FLAGS", "-DMK_ATTN_CHUNK=32")  # as a test forces it
    assert dims.built_attn_chunk() == 32
    assert dims.head_units_cover(128, splits)
    assert not dims.head_units_cover(129, splits)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("shape", ["qwen2.5-coder-1.5b", "odd"])
def test_build_without_group_units_compiles(shape: str, tmp_path: Path) -> None:
    dims = dataclasses.replace(kbuild.KernelDims.from_config(SHAPES[shape]), group_units=False)
    proc = kbuild.compile_check(dims, tmp_path / "decode.o")
    assert proc.returncode == 0, proc.stderr


def test_merge_ranges_mirror_the_kernels_rule() -> None:
    """MK_MERGE_NS: ranges whose partials [ns, Q] fit the input vector's shared memory and
    whose statistics [ns, heads, 4] fit stage B's scratch."""
    want = {"llama-3.2-1b": 4, "qwen2.5-coder-1.5b": 5, "odd": 2}
    for shape, ns in want.items():
        assert kbuild.KernelDims.from_config(SHAPES[shape]).merge_ranges() == ns


def test_flow_copies_mirror_the_kernels_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host allocates as many copies of each hand-off vector as the kernel writes
    (csrc/flow.cuh MK_FLOW_COPIES), also when a build overrides the define."""
    src = (kbuild.CSRC / "flow.cuh").read_text()
    m = re.search(r"#ifndef MK_FLOW_COPIES\n#define MK_FLOW_COPIES (\d+)\n", src)
    assert m is not None, "flow.cuh no longer defines MK_FLOW_COPIES' default"
    monkeypatch.delenv("MONOKERNEL_NVCC_FLAGS", raising=False)
    assert kbuild.flow_copies() == kbuild.FLOW_COPIES == int(m.group(1))
    monkeypatch.setenv("MONOKERNEL_NVCC_FLAGS", "-DMK_SKEW=1 -DMK_FLOW_COPIES=1")
    assert kbuild.flow_copies() == 1


def test_ticket_counters_mirror_the_kernels_stride() -> None:
    """The host's barrier buffer holds the LM head's ticket counters where the kernel looks
    for them: one a warp slot, MK_TICKET_STRIDE words apart (csrc/drawn_rows.cuh)."""
    src = (kbuild.CSRC / "drawn_rows.cuh").read_text()
    m = re.search(r"#define MK_TICKET_STRIDE (\d+)\n", src)
    assert m is not None, "drawn_rows.cuh no longer defines MK_TICKET_STRIDE"
    assert int(m.group(1)) == kbuild.TICKET_STRIDE
    assert (kbuild.CSRC / "common.cuh").read_text().count(f"MK_THREADS {kbuild.THREADS}") == 1


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_gate_up_defines_per_shape_and_a_knob_replaces_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """MK_D_PRE comes from the shape (2 at hidden >= 1536, else 1); a -D knob in
    MONOKERNEL_NVCC_FLAGS or compile_check's extra flags replaces it instead of defining it
    twice."""
    llama = kbuild.KernelDims.from_config(SHAPES["llama-3.2-1b"])
    qwen = kbuild.KernelDims.from_config(SHAPES["qwen2.5-coder-1.5b"])
    assert "-DMK_D_PRE=2" in llama.defines()
    assert "-DMK_D_PRE=2" in qwen.defines()
    small = kbuild.KernelDims.from_config(SHAPES["qwen3-0.6b"])
    assert "-DMK_D_PRE=1" in small.defines()
    # Gate/up loads a lane per row (MK_BATCH2): the build without group units only.
    short = {n: dataclasses.replace(d, group_units=False) for n, d in
             (("llama", llama), ("qwen", qwen), ("small", small))}  # fmt: skip
    assert [short[n].gate_up_batch() for n in ("llama", "qwen", "small")] == [5, 3, 4]
    assert llama.gate_up_batch() == qwen.gate_up_batch() == 4
    # The LM head's tail dealt by tickets (MK_F_DRAWN): below hidden 2048, on one GPU.
    assert "-DMK_F_DRAWN=0" in llama.defines()
    assert "-DMK_F_DRAWN=8" in qwen.defines() and "-DMK_F_DRAWN=8" in small.defines()
    assert "-DMK_F_DRAWN=0" in dataclasses.replace(qwen, tp=2).defines()
    monkeypatch.setenv("MONOKERNEL_NVCC_FLAGS", "-DMK_D_PRE=1")
    cmd = kbuild.nvcc_command(llama, tmp_path / "decode.cubin")
    assert [f for f in cmd if f.startswith("-DMK_D_PRE")] == ["-DMK_D_PRE=1"]
    monkeypatch.delenv("MONOKERNEL_NVCC_FLAGS")
    assert kbuild.cubin_path(llama) != kbuild.cubin_path(
        dataclasses.replace(llama, hidden=small.hidden)
    )


def test_down_split_by_loads_in_flight_and_rows_a_unit() -> None:
    """MK_SPLIT_E: the fewest warps a row that make a warp's slice one batch of loads, halved
    where two such batches in flight would be more than MAX_DOWN_LOADS a lane, unless the
    halved split leaves units with fewer than two rows (Qwen3-0.6B: 6 loads a lane at 2, but
    1,024 rows on 2,112 one-warp units) (step 50)."""
    want = {"llama-3.2-1b": 8, "qwen2.5-coder-1.5b": 4, "qwen3-0.6b": 2, "odd": 1}
    for shape, split in want.items():
        dims = kbuild.KernelDims.from_config(SHAPES[shape])
        assert dims.down_split() == split, shape
        assert f"-DMK_SPLIT_E={split}" in dims.defines()
        assert (dims.intermediate // 8) % split == 0
