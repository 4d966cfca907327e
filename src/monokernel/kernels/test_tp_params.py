"""The TP build of the decode kernel: its Params mirror matches, and it compiles for sm_90a.

CPU only (nvcc, no GPU); the runs on 2 GPUs are in runtime/backends/test_monokernel_tp.py.
"""

from __future__ import annotations

import ctypes
import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest

from monokernel.bench.shapes import SHAPES
from monokernel.kernels import build as kbuild
from monokernel.kernels import launcher
from monokernel.runtime.backends.monokernel_tp import rank_config, recv_buffer_bytes
from monokernel.weights.shard import shard_config

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


def _layout_checks(cls: type[ctypes.Structure]) -> list[str]:
    checks = [f'static_assert(sizeof(Params) == {ctypes.sizeof(cls)}, "sizeof");']
    for klass in reversed(cls.__mro__):
        for name, *_ in getattr(klass, "_fields_", []) if "_fields_" in vars(klass) else []:
            off = getattr(cls, name).offset
            checks.append(f'static_assert(offsetof(Params, {name}) == {off}, "{name}");')
    return checks


@needs_nvcc
@pytest.mark.parametrize("tp", [1, 2])
def test_ctypes_params_match_the_cuda_struct(tp: int, tmp_path: Path) -> None:
    cls = launcher.KernelParamsTP if tp > 1 else launcher.KernelParams
    checks = _layout_checks(cls)
    if tp > 1:
        checks.append(f'static_assert(MK_TP_MAX == {launcher.TP_MAX_RANKS}, "ranks");')
    src = tmp_path / "layout.cu"
    src.write_text(
        f'#include <cstddef>\n#include "{kbuild.CSRC / "params.cuh"}"\n' + "\n".join(checks) + "\n"
    )
    cmd = [kbuild.find_nvcc(), *kbuild.ARCH_FLAGS, f"-DMK_TP={tp}", "-c", "-o", "l.o", str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_tp_params_extend_the_base_layout() -> None:
    base = ctypes.sizeof(launcher.KernelParams)
    assert launcher.KernelParamsTP.tp_recv.offset == base  # the TP tail follows, nothing moves
    assert launcher.KernelParamsTP.pad_.offset == launcher.KernelParams.pad_.offset


def test_rank_dims_and_defines() -> None:
    cfg = SHAPES["qwen2.5-coder-1.5b"]
    sc = shard_config(cfg, 1, 2)
    rc = rank_config(sc)
    assert (rc.num_heads, rc.num_kv_heads, rc.intermediate_size) == (6, 1, 4480)
    assert (
        rc.vocab_size == sc.vocab_local and not rc.tie_word_embeddings and rc.o_bias == cfg.o_bias
    )
    dims = kbuild.KernelDims.from_config(rc)
    assert not any(d.startswith("-DMK_TP=") for d in dims.defines())  # TP=1: no new define
    tp_dims = dataclasses.replace(dims, tp=2)
    assert "-DMK_TP=2" in tp_dims.defines()
    assert kbuild.cubin_path(dims) != kbuild.cubin_path(tp_dims)
    assert recv_buffer_bytes(2, 1536) == 2 * 2 * 1536 * 8 + 2 * 2 * 16


@needs_nvcc
@pytest.mark.parametrize(
    ("shape", "flags"),
    [
        ("qwen2.5-coder-1.5b", ()),
        ("llama-3.2-1b", ()),
        # The LM head's tail by tickets, off in the TP build until measured on two GPUs.
        ("qwen2.5-coder-1.5b", ("-DMK_F_DRAWN=8",)),
    ],
)
def test_tp2_kernel_compiles(shape: str, flags: tuple[str, ...], tmp_path: Path) -> None:
    cfg = SHAPES[shape]
    dims = dataclasses.replace(
        kbuild.KernelDims.from_config(rank_config(shard_config(cfg, 0, 2))), tp=2
    )
    proc = kbuild.compile_check(dims, tmp_path / "decode.o", flags)
    assert proc.returncode == 0, proc.stderr
