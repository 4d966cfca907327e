"""The prefill's QKV epilogue (prefill_qkv.py): the Triton form against the PyTorch form, in
Triton's interpreter on the CPU (its logic: halves, masks, q/k/v rows, scattered positions)
and compiled on a GPU (marker ``gpu``), over real and odd head sizes."""

from __future__ import annotations

import pytest
import torch

from monokernel.models.shapes import SHAPES
from monokernel.runtime.prefill_qkv import (
    QkvEpilogue,
    fused_epilogue_ok,
    qkv_epilogue_agrees,
    rope_factors,
)
from monokernel.testing.triton_interpreter import interpreted
from monokernel.weights.repack import LayerPack

CASES = [(24, 37), (64, 1), (104, 20), (128, 33)]  # (head_dim, tokens)


def test_torch_form_rotates_by_the_tables_and_writes_only_its_positions() -> None:
    """The PyTorch form on a Llama-like layer: q is the rotated projection (checked against
    the rotation written out by hand), the cache holds k rotated and v as is at exactly the
    chunk's positions, by slicing (host-known start) and by index (device positions)."""
    cfg = SHAPES["smollm2-135m"]
    d, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    g = torch.Generator().manual_seed(3)
    angles = torch.rand(40, d // 2, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    qkv = torch.randn(5, (nh + 2 * nkv) * d, generator=g)
    lp = LayerPack(matrices={}, bqkv=None, q_norm=None, k_norm=None, bo=None)  # no matrix read

    def rotate(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # [T, h, d]
        c, s = cos[pos][:, None], sin[pos][:, None]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    for how in ("slice", "index"):
        k_cache = torch.full((1, nkv, 40, d), -9.0)
        v_cache = torch.full((1, nkv, 40, d), -9.0)
        ep = QkvEpilogue(cfg, cos, sin, k_cache, v_cache, fused=False)
        pos = torch.arange(30, 35) if how == "slice" else torch.tensor([7, 3, 30, 12, 0])
        at = ep.rope(30, 35) if how == "slice" else ep.rope_at(pos)
        q = ep(qkv.clone(), lp, 0, at, torch.float32)
        heads = qkv.view(5, nh + 2 * nkv, d)
        torch.testing.assert_close(q, rotate(heads[:, :nh], pos))
        torch.testing.assert_close(
            k_cache[0, :, pos].transpose(0, 1), rotate(heads[:, nh : nh + nkv], pos)
        )
        torch.testing.assert_close(v_cache[0, :, pos].transpose(0, 1), heads[:, nh + nkv :])
        others = torch.ones(40, dtype=torch.bool)
        others[pos] = False
        assert (k_cache[0, :, others] == -9).all() and (v_cache[0, :, others] == -9).all()


def test_rope_factors_match_the_halves_rotation() -> None:
    g = torch.Generator().manual_seed(0)
    cos, sin = torch.rand(9, 4, generator=g), torch.rand(9, 4, generator=g)
    c, s = rope_factors(cos, sin, torch.tensor([2, 8]))
    assert c.shape == s.shape == (2, 1, 8)
    torch.testing.assert_close(c[0, 0], torch.cat((cos[2], cos[2])))
    torch.testing.assert_close(s[1, 0], torch.cat((-sin[8], sin[8])))


@pytest.mark.parametrize("case", CASES, ids=[f"d{d}-t{t}" for d, t in CASES])
def test_triton_epilogue_logic_in_the_interpreter(case: tuple[int, int]) -> None:
    """Both forms on a Qwen3-like layer (bias, q/k-norm, GQA, positions out of order) in
    Triton's interpreter, in a fresh process (the interpreter must be chosen before Triton
    is imported). Its bf16 casts truncate where the GPU rounds to nearest: within 1e-2."""
    call = f"qkv_epilogue_agrees(torch.device('cpu'), *{case!r})"
    assert interpreted("monokernel.runtime.prefill_qkv", call) == "True"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", [*CASES, (64, 500), (128, 513)], ids=str)
def test_triton_epilogue_matches_pytorch_on_the_gpu(case: tuple[int, int]) -> None:
    assert fused_epilogue_ok(torch.device("cuda")), "prefill would run the epilogue unfused"
    assert qkv_epilogue_agrees(torch.device("cuda"), *case)
