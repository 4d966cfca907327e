"""What the bench counts for the monokernel's layers (``engines.monokernel_layers``): the
bytes of the formats its backend streams a checkpoint's groups or FP8 blocks in, the same
count as the ``ENGINE:FORMAT`` labels that stand for those formats."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from monokernel.bench.engines import RunFormats, monokernel_layers
from monokernel.bench.measure import bytes_per_token, layer_matrix_shapes
from monokernel.models.shapes import SHAPES
from monokernel.weights.checkpoint_quant import Fp8Blocks
from monokernel.weights.quantize import LINEAR_NAMES

CFG = SHAPES["llama-3.1-8b"]
CONTEXT = 1000.0


@dataclass(frozen=True, slots=True)
class _Width:
    """A stand-in for an 8B's GroupQuant: the plan reads only its bits, its group and where
    its values lie (on the host, as a GGUF's)."""

    bits: int
    group: int

    @property
    def q(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def widened(self, group: int) -> _Width:
        return _Width(8, group)


def _groups(cfg: Any, widths: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """Each layer matrix of ``cfg`` at ``widths[name]`` (bits, group)."""
    return {
        f"layers.{n}.{m}": _Width(*widths[m]) for n in range(cfg.num_layers) for m in LINEAR_NAMES
    }


# A GGUF Q4_K_M as the loader leaves it (uniform_groups): QKV and down in 8-bit groups of
# 16 (its Q6_K V and down), O and gate/up in Q4_K's 4-bit groups of 32.
Q4_K_M = {m: (4, 32) for m in LINEAR_NAMES} | {m: (8, 16) for m in ("wq", "wk", "wv", "w_down")}


def test_a_q4_k_m_counts_as_the_q4_k_m_label() -> None:
    layers = monokernel_layers(CFG, RunFormats("int8", _groups(CFG, Q4_K_M)))
    assert layers.label == "groups int4-g32, QKV int8-g16, down int8-g16"
    want = bytes_per_token(CFG, CONTEXT, 2, fmt="q4_k_m")
    assert layers.bytes_per_token(CFG, CONTEXT, 2) == pytest.approx(want, rel=1e-12)
    assert want < 0.6 * bytes_per_token(CFG, CONTEXT, 2)  # not the bf16 count


@pytest.mark.parametrize(
    ("widths", "label", "fmt"),
    [
        ({m: (8, 16) for m in LINEAR_NAMES}, "groups int8-g16", "int8-g16"),  # Q6_K
        ({m: (8, 32) for m in LINEAR_NAMES}, "groups int8-g32", "int8-g32"),  # Q8_0
    ],
)
def test_8_bit_groups_count_as_their_labels(
    widths: dict[str, tuple[int, int]], label: str, fmt: str
) -> None:
    layers = monokernel_layers(CFG, RunFormats("int8", _groups(CFG, widths)))
    assert layers.label == label
    want = bytes_per_token(CFG, CONTEXT, 2, fmt=fmt)
    assert layers.bytes_per_token(CFG, CONTEXT, 2) == pytest.approx(want, rel=1e-12)


def test_4_bit_groups_count_their_own_group() -> None:
    """A Q4_0's groups of 32 carry four times the scale bytes of --quantize int4's 128: the
    count is the checkpoint's, not the label's."""
    layers = monokernel_layers(
        CFG, RunFormats("int4", _groups(CFG, dict.fromkeys(LINEAR_NAMES, (4, 32))))
    )
    assert layers.label == "groups int4-g32"
    pairs = 8  # a float32 scale and offset a group
    extra = CFG.num_layers * sum(
        r * (c // 32 - c // 128) * pairs for r, c in layer_matrix_shapes(CFG)
    )
    got = layers.bytes_per_token(CFG, CONTEXT, 2)
    assert got - bytes_per_token(CFG, CONTEXT, 2, fmt="int4") == pytest.approx(extra)


def test_fp8_blocks_and_rows() -> None:
    blocks = Fp8Blocks(128, 128, {})
    layers = monokernel_layers(CFG, RunFormats("fp8", None, blocks))
    assert layers.label == "fp8, 128x128 block scales"
    want = bytes_per_token(CFG, CONTEXT, 2, fmt="fp8-block")
    assert layers.bytes_per_token(CFG, CONTEXT, 2) == pytest.approx(want, rel=1e-12)
    rows = monokernel_layers(CFG, RunFormats("fp8"))
    assert rows.label == "fp8"
    assert rows.bytes_per_token(CFG, CONTEXT, 2) == bytes_per_token(CFG, CONTEXT, 2, fmt="fp8")


def test_what_does_not_stream_packed_counts_dense() -> None:
    """8-bit groups stream only where the sizes are whole tiles: else the backend streams
    their dequantised values in bf16, and so does the count."""
    odd = SHAPES["odd"]  # hidden 520: not whole tiles
    layers = monokernel_layers(odd, RunFormats("int8", _groups(odd, Q4_K_M)))
    assert layers.formats == () and layers.label.startswith("bf16")
    assert layers.bytes_per_token(odd, CONTEXT, 2) == bytes_per_token(odd, CONTEXT, 2)
    assert monokernel_layers(CFG, RunFormats()).bytes_per_token(CFG, CONTEXT, 2) == (
        bytes_per_token(CFG, CONTEXT, 2)
    )


def test_int4_beside_int8_without_int4_tiles_streams_int8() -> None:
    """Where int4 has no tiles (a small model: too few output tiles for the SMs), a Q4_K_M's
    4-bit groups stream widened to 8 bits beside its 8-bit ones (quantize.groups_plan)."""
    small = SHAPES["smollm2-135m"]
    layers = monokernel_layers(small, RunFormats("int8", _groups(small, Q4_K_M)))
    assert layers.label == "groups int8-g16"
    want = bytes_per_token(small, CONTEXT, 2, fmt="int8-g16")
    assert layers.bytes_per_token(small, CONTEXT, 2) == pytest.approx(want, rel=1e-12)


def test_at_tp_a_ranks_sizes_decide() -> None:
    """An intermediate size of whole tiles whose halves are not: at --tp 2 each rank's
    8-bit groups would cut tiles, so the TP backend streams bf16 there, and the count
    follows it; at one GPU they stream. The count is the whole model's either way."""
    cfg = dataclasses.replace(CFG, intermediate_size=64 * 225)
    run = RunFormats("int8", _groups(cfg, dict.fromkeys(LINEAR_NAMES, (8, 16))))
    one, two = monokernel_layers(cfg, run), monokernel_layers(cfg, run, tp=2)
    assert one.label == "groups int8-g16" and two.label.startswith("bf16")
    assert two.bytes_per_token(cfg, CONTEXT, 2) == bytes_per_token(cfg, CONTEXT, 2)
    q4 = RunFormats("int8", _groups(CFG, Q4_K_M))
    assert monokernel_layers(CFG, q4, tp=2).bytes_per_token(CFG, CONTEXT, 2) == (
        monokernel_layers(CFG, q4).bytes_per_token(CFG, CONTEXT, 2)
    )
