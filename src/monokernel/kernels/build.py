"""JIT build of the monokernel: nvcc -> cubin, specialised on the model's dimensions, cached.

The cubin's cache key hashes the sources, the -D defines, the flags and the target arch,
so any change rebuilds and nothing stale is ever loaded. Two processes building the same key
at once are safe: a file lock serialises them, and the cubin is written to a temporary name
then renamed into place (readers never see a half-written file).

A build's -D defines are the model's dimensions, then the per-shape choices of ``CHOICES``:
each a rule on the shape, documented once in its method below (``python -m
monokernel.kernels.build --knobs`` prints them as docs/kernel-knobs.md). Everything else the
kernel tunes is fixed (csrc/tunables.cuh), and every layout it shares with the host comes
from kernels/layout.py. Settings (monokernel/envs.py): ``MONOKERNEL_NVCC``,
``MONOKERNEL_NVCC_FLAGS`` (a ``-DMK_<choice>=N`` there replaces the shape's value, for tests
and experiments), ``MONOKERNEL_VERBOSE_BUILD``, ``MONOKERNEL_DEBUG_BUILD``.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from monokernel import envs
from monokernel.errors import BackendUnavailableError, UnsupportedModelError
from monokernel.kernels import layout
from monokernel.kernels.plan import ATTN_MIN_RANGE, head_units_fit
from monokernel.models.config import ModelConfig
from monokernel.weights.formats import FORMATS
from monokernel.weights.formats.int4 import GROUPS as INT4_GROUPS
from monokernel.weights.formats.int8 import GROUPS as INT8_GROUPS
from monokernel.weights.formats.tiles import (
    TILE_COLS,
    TILE_FORMATS,
    TILE_ROWS,
    block_fits,
    tiles_for,
)

CSRC = Path(__file__).parent / "csrc"
ENTRY = "decode.cu"
KERNEL_NAME = "mk_decode"
ARCH_FLAGS = ("-gencode=arch=compute_90a,code=sm_90a",)
THREADS = layout.THREADS  # a CTA's threads, for the launch
WARPS = layout.WARPS
BATCH = 6  # kBatch in csrc/tunables.cuh: 16-byte loads a lane keeps in flight for one row
# Loads a lane keeps in flight per pipelined down-projection row (down_split).
MAX_DOWN_LOADS = 4
# SMs of the GPUs the kernel is tuned on (H100 SXM, H200): down_split's rows-per-unit rule
# and the kernel's (MK_SMS: which GEMVs of a pass spread their positions, gemv_pass.cuh) use
# it; the grid itself is the device's SM count, read at launch.
HOPPER_SMS = 132
# Where an int4 tile slice may start (csrc/formats/int4_tiles.cuh kSliceCols): on any load,
# one 64-column input block, inside a group of 128 or more.
INT4_SLICE_COLS = TILE_COLS
MAX_HEAD_DIM = 256
# KernelDims.weight_format / head_format -> the C++ format type (csrc/formats/):
# MK_WEIGHT_FORMAT / MK_HEAD_FORMAT.
WEIGHT_FORMATS: dict[str, str] = {name: f.kernel_type for name, f in FORMATS.items()}


# Positions a verify pass computes at most (dims.cuh checks the same bound).
MAX_PASS_POSITIONS = 8


@dataclass(frozen=True, slots=True)
class KernelDims:
    """The compile-time shape of one kernel build (the -D defines)."""

    hidden: int
    q_size: int
    kv_size: int
    intermediate: int
    vocab: int
    layers: int
    head_dim: int
    heads: int
    kv_heads: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    # Tensor-parallel ranks (MK_TP); the other dims are then one rank's.
    tp: int = 1
    # False: the build without group units (MK_ATTN_GROUP=0), for contexts head units cover.
    group_units: bool = True
    weight_format: str = "bf16"  # the layers' matrices: a key of WEIGHT_FORMATS
    head_format: str = "bf16"  # the LM head's (the checkpoint's own under --quantize)
    # The columns one scale covers where it is not a row's: int4's groups (weights/formats/
    # int4.py), fp8's blocks (a checkpoint's block scales, fp8.py; tiles only), int8's
    # groups (a GGUF file's 5- to 8-bit blocks, int8.py; tiles only); 0 otherwise.
    weight_group: int = 0
    # Whether the layers' format streams 16-row tiles on the tensor cores (int4 and fp8 where
    # weights/formats/tiles.py tiles_for says so; csrc/gemv_tiles.cuh) rather than rows on
    # the CUDA cores. None: decided at construction (MONOKERNEL_WEIGHT_LAYOUT read once, so
    # a later build of these dims is the kernel their weights were packed for); None with
    # a format that has no tiles.
    weight_tiles: bool | None = None
    # The whole vocabulary under tensor parallelism (``vocab`` is then a rank's rows): top-k /
    # top-p draw over all of it. 0: ``vocab``.
    vocab_all: int = 0
    # The fused QKV's and the down projection's format and group where they differ from the
    # other layer matrices' ("": as those): a GGUF Q4_K_M's V and down projections in 6 bits
    # (int8 groups) beside int4 tiles. Tile formats only (check_formats).
    qkv_format: str = ""
    qkv_group: int = 0
    down_format: str = ""
    down_group: int = 0
    # Positions one verify pass computes (MK_P; 1: the one-token step). A pass build is planned
    # exactly as the step build of the same dims (its window and attention ranges), so each of
    # its positions is computed as a step would compute it (docs/speculative.md).
    positions: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.positions <= MAX_PASS_POSITIONS or (self.positions > 1 and self.tp > 1):
            raise ValueError(
                f"positions {self.positions}: a verify pass computes 1 to {MAX_PASS_POSITIONS} "
                "positions, on one GPU"
            )
        if self.weight_tiles is None and self.weight_format == "int8" and self.weight_group:
            object.__setattr__(self, "weight_tiles", True)  # int8 groups exist only in tiles
        if self.weight_tiles is None and self.weight_format in TILE_FORMATS:
            tiles = tiles_for(
                self.weight_format, self.hidden, self.q_size, self.kv_size, self.intermediate
            )
            object.__setattr__(self, "weight_tiles", tiles)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> KernelDims:
        check_supported(cfg)
        dims = cls(
            hidden=cfg.hidden_size,
            q_size=cfg.q_size,
            kv_size=cfg.kv_size,
            intermediate=cfg.intermediate_size,
            vocab=cfg.vocab_size,
            layers=cfg.num_layers,
            head_dim=cfg.head_dim,
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            qkv_bias=cfg.qkv_bias,
            o_bias=cfg.o_bias,
            qk_norm=cfg.qk_norm,
        )
        if dims.attn_chunk() < 32:
            raise UnsupportedModelError(
                f"the monokernel's shared memory ({layout.MAX_SMEM_BYTES} bytes a CTA) cannot "
                f"hold this shape's vectors and an attention window of 32 positions "
                f"(hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, "
                f"head_dim {cfg.head_dim})"
            )
        return dims

    def defines(self, flags: Sequence[str] | None = None) -> list[str]:
        """The build's -D defines: the dimensions, then the per-shape choices (with the
        overrides ``flags`` hold, by default MONOKERNEL_NVCC_FLAGS'), then the shared memory
        layout.py computes for them."""
        self.check_formats()
        vals: dict[str, int | str] = {
            "MK_H": self.hidden,
            "MK_Q": self.q_size,
            "MK_KV": self.kv_size,
            "MK_I": self.intermediate,
            "MK_V": self.vocab,
            "MK_V_ALL": self.vocab_all or self.vocab,
            "MK_L": self.layers,
            "MK_D": self.head_dim,
            "MK_NH": self.heads,
            "MK_NKV": self.kv_heads,
            "MK_QKV_BIAS": int(self.qkv_bias),
            "MK_O_BIAS": int(self.o_bias),
            "MK_QK_NORM": int(self.qk_norm),
            "MK_WEIGHT_FORMAT": self.kernel_format(),
            **{
                f"MK_{stage.upper()}_FORMAT": self.kernel_format(stage)
                for stage in ("qkv", "down")
                if getattr(self, f"{stage}_format")
            },
            "MK_HEAD_FORMAT": WEIGHT_FORMATS[self.head_format],
            "MK_TILES": int(bool(self.weight_tiles)),
            "MK_SUM_SPLIT": layout.sum_split(self),
            "MK_P": self.positions,
            "MK_SMS": HOPPER_SMS,
            **(choices := self.choices(flags)),
            "MK_SMEM_BYTES": self.checked_smem(choices["MK_ATTN_CHUNK"]),
        }
        return [f"-D{k}={v}" for k, v in vals.items()]

    def checked_smem(self, attn_chunk: int) -> int:
        """Shared memory of the build with this window; refuses a pass build whose positions'
        vectors leave no room for the step build's window (it must keep the step's plan)."""
        n = layout.smem_bytes(self, attn_chunk)
        if n > layout.MAX_SMEM_BYTES:
            raise UnsupportedModelError(
                f"a verify pass of {self.positions} positions needs {n} bytes of shared memory "
                f"a CTA with this shape's attention window of {attn_chunk} positions; a CTA "
                f"has {layout.MAX_SMEM_BYTES} (hidden {self.hidden}, intermediate "
                f"{self.intermediate}): fewer positions, or a smaller model"
            )
        return n

    def stage_format(self, stage: str = "") -> tuple[str, int]:
        """(format, group) of the layers' matrices, or of stage ``qkv`` / ``down``'s."""
        own = getattr(self, f"{stage}_format") if stage else ""
        if own:
            return own, getattr(self, f"{stage}_group")
        return self.weight_format, self.weight_group

    def stage_formats(self) -> list[tuple[str, int]]:
        """(format, group) of every layer stage: the layers', then QKV's and down's own."""
        return [self.stage_format(s) for s in ("", "qkv", "down")]

    def kernel_format(self, stage: str = "") -> str:
        """The layers' C++ format type (or stage ``qkv`` / ``down``'s): int4's is a template
        over its group."""
        fmt, group = self.stage_format(stage)
        cxx = WEIGHT_FORMATS[fmt]
        if fmt == "fp8" and group:
            return f"Fp8BlockTiles<{group}>"
        if fmt == "int8" and group:
            return f"Int8GroupTiles<{group}>"
        if self.weight_tiles:
            cxx = {"int4": "Int4Tiles", "fp8": "Fp8Tiles"}[fmt]
        return f"{cxx}<{group}>" if fmt == "int4" else cxx

    def check_formats(self) -> None:
        """Refuse a format the kernel has no type for, or a shape whose rows are not whole
        16-byte loads in it (a GEMV reads a row in loads of ``weights_per_load`` weights),
        or for int4 whole groups."""
        for what, name in (("weight", self.weight_format), ("LM head", self.head_format)):
            if name not in WEIGHT_FORMATS:
                raise UnsupportedModelError(
                    f"{what} format {name!r}; the kernel has {', '.join(sorted(WEIGHT_FORMATS))}"
                )
        if self.head_format == "int4":
            raise UnsupportedModelError("LM head format 'int4': the head streams bf16, fp8 or int8")
        if (self.weight_format == "int4") and not self.weight_group:
            raise UnsupportedModelError("weight format 'int4' needs a group size")
        if self.weight_group and self.weight_format not in ("int4", "fp8", "int8"):
            raise UnsupportedModelError(
                f"weight group {self.weight_group} with format {self.weight_format!r}: "
                "int4's and int8's groups and fp8's block scales have one, no other format"
            )
        int8_groups = self.weight_format == "int8" and self.weight_group
        if int8_groups and (self.weight_group not in INT8_GROUPS or not self.weight_tiles):
            raise UnsupportedModelError(
                f"int8 groups of {self.weight_group} columns: the kernel reads groups of "
                f"{INT8_GROUPS} in 16-row tiles"
            )
        fp8_blocks = self.weight_format == "fp8" and self.weight_group
        if fp8_blocks and not (self.weight_tiles and block_fits(self.weight_group)):
            raise UnsupportedModelError(
                f"fp8 block scales of {self.weight_group} columns: the kernel reads them in "
                f"16-row tiles (MONOKERNEL_WEIGHT_LAYOUT), blocks a power of two of at least "
                f"{TILE_COLS} columns"
            )
        if self.weight_format == "int4" and self.weight_group not in INT4_GROUPS:
            raise UnsupportedModelError(
                f"int4 groups of {self.weight_group} columns; the kernel reads {INT4_GROUPS}"
            )
        n = max(FORMATS[self.weight_format].weights_per_load, self.weight_group)
        if self.weight_tiles:
            n = max(n, TILE_COLS)
        rows = {
            "hidden": self.hidden,
            "q heads x head_dim": self.q_size,
            "intermediate": self.intermediate,
        }
        odd = [f"{k} {v}" for k, v in rows.items() if v % n]
        if odd:
            raise UnsupportedModelError(
                f"weight format {self.weight_format!r} reads rows in units of {n} weights; this "
                f"shape's {', '.join(odd)} is not a multiple of {n}"
            )
        qkv = self.q_size + 2 * self.kv_size
        if self.weight_tiles and qkv % TILE_ROWS:
            raise UnsupportedModelError(
                f"weight format {self.weight_format!r} streams tiles of {TILE_ROWS} rows; this "
                f"shape's fused QKV projection has {qkv} (q + 2 kv heads x head_dim)"
            )
        for stage in ("qkv", "down"):
            fmt, group = getattr(self, f"{stage}_format"), getattr(self, f"{stage}_group")
            if not fmt:
                continue
            ok = self.weight_tiles and (
                (fmt == "int8" and group in INT8_GROUPS) or (fmt == "int4" and group in INT4_GROUPS)
            )
            if not ok:
                raise UnsupportedModelError(
                    f"stage {stage} in {fmt} (group {group}) beside layers in "
                    f"{self.weight_format}: a stage of its own format needs tiles throughout "
                    f"(int4 groups of {INT4_GROUPS} or int8 groups of {INT8_GROUPS})"
                )
        if self.hidden % FORMATS[self.head_format].weights_per_load:
            raise UnsupportedModelError(
                f"LM head format {self.head_format!r}: hidden {self.hidden} is not a multiple "
                f"of {FORMATS[self.head_format].weights_per_load}"
            )

    def choices(self, flags: Sequence[str] | None = None) -> dict[str, int]:
        """Each per-shape choice's define and value: the rule's, unless ``flags`` (by default
        MONOKERNEL_NVCC_FLAGS) set it (``-DMK_ATTN_CHUNK=32``: tests force small windows)."""
        out = {c.define: c.rule(self) for c in CHOICES}
        out.update(choice_overrides(flags))
        # E's streamed input exists only where it can with the splits and batch taken
        # (csrc/cta.cuh checks the same): off wherever the splits an override picks leave
        # no room for it.
        can = self._down_streams(out["MK_SPLIT_E"], out["MK_TILE_BATCH"])
        out["MK_E_STREAM"] = min(out["MK_E_STREAM"], int(can))
        if out["MK_ATTN_MIN_RANGE"] < 1:
            raise ValueError(f"MK_ATTN_MIN_RANGE={out['MK_ATTN_MIN_RANGE']}: a positive count")
        chunk = out["MK_ATTN_CHUNK"]
        if chunk % 32 or not 32 <= chunk <= self.attn_chunk():
            raise ValueError(
                f"MK_ATTN_CHUNK={chunk}: a multiple of 32 up to {self.attn_chunk()} "
                "(what shared memory holds for this shape)"
            )
        return out

    # ---- the per-shape choices (CHOICES); each docstring is the knob's documentation ----

    def tile_split(self, k: int) -> int:
        """A tile format's warps a tile (split K, csrc/gemv_tiles.cuh) for an input of k:
        the most, up to all 16 of a CTA, whose slices start on a group (64 columns at
        least). A tile is 16 rows, so a stage has 16x fewer units than rows; all 16 warps of
        a CTA on each tile keep every warp streaming while the CTA has tiles left.
        Llama-3.1-8B int4 (perf-notes step 77): 16 everywhere 2,774 µs/token; the gate/up
        projection at 1, 2 or 4 warps a tile 2,826-2,970 (batches of 3: 2,981 at 16), the
        down projection at 8 2,959, QKV at 4 and O at 8 3,006. An override may split int4's
        groups wider than a load (slices then start inside a group: csrc/gemv.cuh
        slice_phase): Qwen2.5-Coder-32B int4 (step 104), 8 warps everywhere 8,770.7 µs/token,
        16 everywhere 9,168.4, O and down at 16 8,586.7."""
        unit = max(64, *(g for _, g in self.stage_formats()))
        for split in (16, 8, 4, 2):
            if k % (split * unit) == 0:
                return split
        return 1

    def qkv_tile_split(self) -> int:
        """Stage A's (QKV) warps a tile in a tile format (tile_split of hidden); 1 otherwise
        (unused: rows split by kSplitA)."""
        return self.tile_split(self.hidden) if self.weight_tiles else 1

    def o_tile_split(self) -> int:
        """Stage C's (O projection) warps a tile in a tile format (tile_split of q heads x
        head_dim); 1 otherwise (unused: rows split by kSplitC)."""
        return self.tile_split(self.q_size) if self.weight_tiles else 1

    def gate_up_tile_split(self) -> int:
        """Stage D's (gate/up) warps a tile in a tile format (tile_split of hidden); 1
        otherwise (unused: one warp a gate/up pair of rows)."""
        return self.tile_split(self.hidden) if self.weight_tiles else 1

    def tile_batch(self) -> int:
        """A tile format's 16-byte loads a lane issues together, with the next batch in
        flight behind them (csrc/gemv_tiles.cuh). int4: 4 where a batch holds whole groups
        of 128 or 256 columns (then only a group's first load reads its pair: 8B int4 on one
        backend, perf-notes step 82, 2,477.8 µs/token against 2,651.7 / 2,596.3 at 5 / 6);
        5 with groups of 64 (a pair a load; steps 77-78: 2,655 at 5 against 2,743 / 2,761
        at 4 / 6); 3 with groups of 32 (two pairs a load, a GGUF Q4_0/Q4_1/Q4_K's; step 83,
        one backend each: 3,189.0 against 3,261.4 / 3,464.9 at 4 / 5). fp8: 4 (step 79:
        3,206.7 against 3,252.2 / 3,210.3 at 6 / 8). 1 where the format is not tiled
        (unused)."""
        if not self.weight_tiles:
            return 1
        if ("int4", 32) in self.stage_formats():
            return 3
        if self.weight_format == "int4" and self.weight_group == 64:
            return 5
        return 4

    def down_split(self) -> int:
        """Warps per row of the down projection (a tile format: per tile, tile_split of
        the intermediate size, or where int4's groups are wider than a load the split whose
        last round of tiles ends first: _down_tile_split): the fewest that make each warp's
        slice one batch of loads (at most BATCH a lane), so rows pipeline without a third
        buffer; but half that where two such batches in flight would hold more than
        MAX_DOWN_LOADS loads a lane (bytes in flight beyond ~30 KB a SM only queue) and the
        wider slices still leave every unit two rows or more on 132 SMs (fewer rows than
        units leave warps idle).

        Then doubled while the doubled split's row slices still fit the grid's warps (hidden
        x split <= 132 x 16) in whole slices: where rows are fewer than warps, a row's lanes
        each dot several loads while other warps idle, so spreading the row over the idle
        warps shortens the stage (and a verify pass's, whose lanes dot each load once a
        position). One H200, 1 -> 2: the default model's shape (576 rows) took the step from
        530 to 496 µs in int4 groups of 32 and from 529 to 504 in bf16, a pass of 4 from
        1,497 to 1,392 and from 1,241 to 1,121; Qwen3-0.6B's (1,024 rows) from 845 to 777 in
        int4 and from 794 to 716 in fp8 (perf-notes step 108)."""
        if self.weight_tiles:
            return self._down_tile_split()
        chunks = self.intermediate // FORMATS[self.weight_format].weights_per_load
        unit = 8 if self.weight_format == "int4" else 1  # int4's slices: whole 8 chunks
        for split in (1, 2, 4, 8, 16):
            loads = -(-chunks // split // 32)  # a lane's loads in one row slice
            if chunks % (split * unit) or loads > BATCH:
                continue
            half = split // 2
            if loads > MAX_DOWN_LOADS and half and self.hidden >= 2 * HOPPER_SMS * (WARPS // half):
                return half
            while (
                split < 16
                and self.hidden * 2 * split <= HOPPER_SMS * WARPS
                and chunks % (2 * split * unit) == 0
            ):
                split *= 2
            return split
        return 16 if chunks % 16 == 0 else 1

    def _down_tile_split(self) -> int:
        """down_split in a tile format: tile_split of the intermediate size, unless int4's
        groups are wider than a load and a split with slices starting inside a group
        (csrc/gemv.cuh slice_phase) ends its last round of tiles sooner. A round is a tile
        for each of the grid's units (16 / split a CTA), and a tile's time goes as its
        slice's columns, so the last round ends at rounds x slice. Measured on one backend,
        int4 in groups of 128, µs/token (perf-notes step 105):
        - Qwen2.5-Coder-32B (E's 320 tiles, K 27,648): 8 warps two rounds of 3,456 columns,
          16 three of 1,728: 8,757.8 -> 8,485.9 (16 without the streamed input 8,562.8).
          Qwen3-14B 8 -> 16: 4,197.9 -> 4,109.9; Qwen2.5-Coder-7B 4 -> 8: 2,424.9 ->
          2,288.9; Qwen3-4B 4 -> 8: 1,801.3 -> 1,697.0 (one H100).
        - TP=2 ranks, 2 -> 4 (2x H200): Qwen2.5-Coder-7B 1,731.4 -> 1,533.9, Qwen2.5-Coder-14B
          2,681.0 -> 2,482.4.
        - Qwen2.5-Coder-14B on one GPU (K 13,824): 4 and 8 both end at 3,456 columns, and 8
          lost (4,212.8 -> 4,355.7, one H100), so a tie keeps whole groups."""
        aligned = self.tile_split(self.intermediate)
        fmt, group = self.stage_format("down")
        if fmt != "int4" or group <= INT4_SLICE_COLS:
            return aligned
        tiles = self.hidden // TILE_ROWS

        def last_round_ends(split: int) -> int:
            units = HOPPER_SMS * (WARPS // split)
            return -(-tiles // units) * (self.intermediate // split)

        for split in (16, 8, 4, 2):
            if split <= aligned:
                break
            if self.intermediate % (split * INT4_SLICE_COLS) == 0 and last_round_ends(
                split
            ) < last_round_ends(aligned):
                return split
        return aligned

    def gate_up_batch(self) -> int:
        """Loads a lane keeps in flight per gate/up row (two rows stream together). More loads
        in flight pay while they fit the registers, and where that ends depends on the
        build's register schedule more than on anything we can predict, so every value here
        was measured side by side (`tools/kernel_variants.py`; perf-notes steps 95, 100-102):
        - int4: 2 (a load is 24 bytes of registers with its group's pair): 8B 3,288 ->
          2,887 µs/token against 4; the 1B and the 1.5B unchanged (1 or 3 no better).
        - A TP rank of the wide, short shape (the 32B at TP=2: hidden 5,120, intermediate
          13,824, under 4 x hidden): 6 in both builds, 10% faster than 5, 2.6% than 8 (7 / 4
          cost it 44%); with q/k norms (Qwen3, unmeasured) the 5 it had.
        - The 32B on one GPU (hidden above 4,096, not wide and short): 6 in both builds. Its
          40 heads on 132 CTAs with a 96-position window leave head units 288 positions, so
          even a 64-token prompt runs the build with group units, where 4 cost it 2.0-2.3%.
        - The build with group units (every context past what head units cover): from
          hidden 3,584 on, 6, one GPU or a TP rank; 5 for the wide, short 14B presets (6 cost
          Qwen3-14B 12-17%); else 4 (5 and 6 lost 1-4% on the 1B, Qwen3-4B and the 1.5B and
          its TP rank). At a 4,096-token prompt, one H100: Llama-3.1-8B 6,363.8 -> 5,943.2,
          Qwen2.5-7B 5,696.0 -> 5,575.9, Qwen3-8B 6,575.5 -> 6,352.3, Qwen2.5-14B 10,875.0 ->
          10,763.7, Qwen3-14B 10,771.0 -> 10,679.0; the 8B's TP=2 rank 2,693.9 -> 2,612.6
          (2x H200).
        - The build without group units: the 14B presets 6 (4 with q/k norms: 6 cost
          Qwen3-14B 5.4%, 7 Qwen2.5-14B 0.6%, 5 ~16%); 5 from hidden 2,048; 3 at hidden
          1,536-2,047; else 4."""
        if self.weight_format == "int4":
            return 2
        wide_short = self.hidden > 4096 and self.intermediate < 4 * self.hidden
        if self.tp > 1 and wide_short:
            return 5 if self.qk_norm else 6
        if self.hidden > 4096 and not wide_short and self.tp == 1:  # the 32B
            return 6
        if self.group_units:
            if wide_short:
                return 5
            return 6 if self.hidden >= 3584 else 4
        if wide_short:
            return 4 if self.qk_norm else 6
        if self.hidden >= 2048:
            return 5
        return 3 if self.hidden >= 1536 else 4

    def gate_up_rows_before_input(self) -> int:
        """Rows of stage D's first gate/up pair issued before the hand-off C -> D: 2 at
        hidden >= 1536, else 1 (the rest go out once D's input is in). Fewer bytes in flight
        at a hand-off make its polls' L2 round trips shorter, at the price of D's first
        loads starting later; since D's input settles through registers, both rows early
        pay on the measured shapes. The smaller shapes are unmeasured."""
        return 2 if self.hidden >= 1536 else 1

    def lm_head_drawn_rows(self) -> int:
        """LM-head rows a warp takes, on average, from the tail dealt by tickets at run time
        (csrc/drawn_rows.cuh; 0: every row dealt statically): 8 below hidden 2048 on one GPU,
        else 0. The SMs stream at unequal rates, so a static deal waits for the slowest; the
        tickets pay where the LM head is a large share of the step (Qwen2.5-1.5B), not on
        Llama-3.2-1B. The TP build, unmeasured on two GPUs, keeps the static deal; the odd
        test shape, whose whole vocabulary is a tail, keeps the ticket path tested."""
        return 8 if self.hidden < 2048 and self.tp == 1 else 0

    def down_input_streamed(self) -> int:
        """1: where D and E stream tiles and E's 16 warps each own a slice of its input of
        more than one batch of loads (csrc/cta.cuh kEStream checks the same), each warp of E
        fetches its own slice and starts on it before the slice's last batch's columns are
        in, and D writes those columns last (csrc/flow.cuh TileInputsStreamed, csrc/gemv.cuh
        TilesTailsLast); the same sums in the same order, so the same bits. Elsewhere it
        changes nothing. Llama-3.1-8B, one backend, interleaved (perf-notes step 103): fp8
        3,091.5 -> 3,034.1 µs/token, int4 2,235.0 -> 2,213.2 (another H100: 3,144.3 ->
        3,087.6, 2,273.0 -> 2,261.4). 0: E waits for its whole input, as every other stage
        (``-DMK_E_STREAM=0`` turns it off; 1 is taken only where it applies)."""
        return int(self._down_streams(self.down_split(), self.tile_batch()))

    def _down_streams(self, split: int, batch: int) -> bool:
        """Whether E's input can stream with E at ``split`` warps a tile and tile batches of
        ``batch`` loads (down_input_streamed)."""
        if not self.weight_tiles or self.positions > 1 or split != WARPS:
            return False
        down_format, _ = self.stage_format("down")
        # 16-byte chunks in one warp's slice of a tile; a lane loads one in 32 of them.
        chunks = self.intermediate // WARPS * TILE_ROWS // FORMATS[down_format].weights_per_load
        return chunks // 32 > batch  # a lane's loads in the slice: more than one batch

    def attn_chunk(self) -> int:
        """Positions of one attention range held in shared memory (K and V, bf16): as many as
        the CTA's shared memory leaves room for (layout.py's carve-up), a multiple of 32, at
        most 512."""
        return layout.max_attn_chunk(replace(self, positions=1))

    def attn_range(self) -> int:
        """Positions per head-unit range at short context (0: one range per window): two
        score passes' worth, 4 x THREADS / CHP (CHP = a key row's 16-byte chunks rounded up to
        a power of two): 256 at head_dim 64, 128 at 128. A head unit sits on the
        latency-bound chain A -> B -> C, so shorter ranges on more units shorten the chain,
        and stage C's input load merges them at no extra round trip."""
        chp = 2
        while chp < self.head_dim // 8:
            chp *= 2
        return 2 * (2 * THREADS // chp)

    def attn_min_range(self) -> int:
        """Group units' fewest positions a range (csrc/attention_window.cuh attn_plan): a KV
        head's context is cut into ranges of at least this many positions, one a CTA, up to
        grid // kv_heads ranges. 64 since group units were built for long context (perf-notes
        step 17), where the cap binds and this does not; it binds between the contexts head
        units cover and 64 x grid // kv_heads positions (the 32B: 288 to ~1,000), where group
        units cost the 1.5B 5.5 µs a layer more than head units at a short context (session
        48); fewer positions a range there are unmeasured."""
        return ATTN_MIN_RANGE

    def built_attn_min_range(self) -> int:
        """Group units' fewest positions a range in the build (MONOKERNEL_NVCC_FLAGS may set
        it)."""
        return self.choices()["MK_ATTN_MIN_RANGE"]

    def attn_group_units(self) -> int:
        """1: the build with group units (any context); 0: the build without, for contexts
        head units cover (the backend loads both and picks by context): their code's
        registers then weigh on nothing. A plan that needs group units traps there."""
        return int(self.group_units)

    def tp_ranks(self) -> int:
        """Tensor-parallel ranks (1: the single-GPU kernel, every TP addition compiled away;
        docs/tensor-parallel.md)."""
        return self.tp

    # ---- what the host needs of the build -------------------------------------------------

    def built_attn_chunk(self) -> int:
        """The window the build has (MONOKERNEL_NVCC_FLAGS may set a smaller one)."""
        return self.choices()["MK_ATTN_CHUNK"]

    def built_attn_range(self) -> int:
        """The head-unit range the build has (MONOKERNEL_NVCC_FLAGS may set it)."""
        return self.choices()["MK_ATTN_RANGE"]

    def merge_ranges(self) -> int:
        """Head-unit ranges stage C's input load merges at most (layout.py MERGE_NS)."""
        return layout.merge_ranges(self)

    def head_units_cover(self, context: int, heads_splits: int) -> bool:
        """Whether stage B's plan (attention_window.cuh) uses head units only, up to
        ``context`` positions, given ``heads_splits`` = grid // heads."""
        return head_units_fit(context, self.built_attn_chunk(), heads_splits)

    def smem_bytes(self) -> int:
        """Dynamic shared memory of one CTA (layout.py's carve-up, this build's window)."""
        return layout.smem_bytes(self, self.choices()["MK_ATTN_CHUNK"])


@dataclass(frozen=True, slots=True)
class Choice:
    """A per-shape choice: the -D ``define`` and the KernelDims method that computes it
    (whose docstring documents it)."""

    define: str
    method: Callable[[KernelDims], int]

    def rule(self, dims: KernelDims) -> int:
        return self.method(dims)

    @property
    def doc(self) -> str:
        return inspect.cleandoc(self.method.__doc__ or "")


CHOICES: tuple[Choice, ...] = (
    Choice("MK_TP", KernelDims.tp_ranks),
    Choice("MK_ATTN_GROUP", KernelDims.attn_group_units),
    Choice("MK_SPLIT_E", KernelDims.down_split),
    Choice("MK_BATCH2", KernelDims.gate_up_batch),
    Choice("MK_D_PRE", KernelDims.gate_up_rows_before_input),
    Choice("MK_F_DRAWN", KernelDims.lm_head_drawn_rows),
    Choice("MK_TILE_SPLIT_A", KernelDims.qkv_tile_split),
    Choice("MK_TILE_SPLIT_C", KernelDims.o_tile_split),
    Choice("MK_TILE_SPLIT_D", KernelDims.gate_up_tile_split),
    Choice("MK_TILE_BATCH", KernelDims.tile_batch),
    Choice("MK_E_STREAM", KernelDims.down_input_streamed),
    Choice("MK_ATTN_CHUNK", KernelDims.attn_chunk),
    Choice("MK_ATTN_MIN_RANGE", KernelDims.attn_min_range),
    Choice("MK_ATTN_RANGE", KernelDims.attn_range),
)
# Choices the build's own fields decide (the host loads builds by them): never overridden.
STRUCTURAL = ("MK_TP", "MK_ATTN_GROUP")
# -D names the flags may carry besides the choices: the stage-skew probe build and the debug
# build's asserts.
BUILD_DEFINES = ("MK_SKEW", "MK_DEBUG")


def _flag_defines(flags: Sequence[str]) -> dict[str, str]:
    """The -DNAME=VALUE (or -DNAME) flags among ``flags``, by name."""
    out = {}
    for f in flags:
        if f.startswith("-D"):
            name, _, value = f[2:].partition("=")
            out[name] = value
    return out


def choice_overrides(flags: Sequence[str] | None = None) -> dict[str, int]:
    """The per-shape choices MONOKERNEL_NVCC_FLAGS (or ``flags``) sets. Refuses a -DMK_ name
    that is neither an overridable choice nor one of BUILD_DEFINES: the dimensions and the
    builds' structure come from the shape, and a retired knob would be silently ignored."""
    if flags is None:
        flags = envs.MONOKERNEL_NVCC_FLAGS.split()
    names = {c.define for c in CHOICES} - set(STRUCTURAL)
    out = {}
    for name, value in _flag_defines(flags).items():
        if not name.startswith("MK_") or name in BUILD_DEFINES:
            continue
        if name not in names:
            raise ValueError(
                f"-D{name}: not a kernel knob that flags may set (the per-shape choices are "
                f"{', '.join(sorted(names))}; docs/kernel-knobs.md)"
            )
        try:
            out[name] = int(value)
        except ValueError:
            raise ValueError(f"-D{name}={value}: expected an integer") from None
    return out


def knobs_markdown() -> str:
    """docs/kernel-knobs.md: the per-shape choices, their values on the catalogue's shapes,
    and the fixed tunables' header."""
    from monokernel.models.shapes import SHAPES

    dims = {name: KernelDims.from_config(cfg) for name, cfg in SHAPES.items()}
    lines = [
        "# Kernel knobs",
        "",
        "Generated by `python -m monokernel.kernels.build --knobs` from",
        "`src/monokernel/kernels/build.py` (its `CHOICES` table); do not edit by hand (a test",
        "checks it is current).",
        "",
        "The decode kernel is specialised on the model's dimensions and on the per-shape",
        "choices below, each a rule on the shape that build.py passes as a `-D` define. Any",
        "of them except `MK_TP` and `MK_ATTN_GROUP` (which pick the build the host loads) can",
        "be replaced for an experiment with `MONOKERNEL_NVCC_FLAGS=-DMK_<NAME>=<value>`; the",
        "host follows the override. Every other tunable is a fixed constant with its reason",
        "in `src/monokernel/kernels/csrc/tunables.cuh`, and every layout the host shares with",
        "the kernel comes from `src/monokernel/kernels/layout.py`. Where the two builds the",
        "backend loads differ, the table shows the value with group units / without.",
        "",
        "| Define | " + " | ".join(f"`{n}`" for n in dims) + " |",
        "|---|" + "---|" * len(dims),
    ]
    for c in CHOICES:
        vals = []
        for d in dims.values():
            full, short = c.rule(d), c.rule(dataclasses.replace(d, group_units=False))
            vals.append(str(full) if full == short else f"{full} / {short}")
        lines.append(f"| `{c.define}` | {' | '.join(vals)} |")
    lines.append("")
    for c in CHOICES:
        lines += [f"## `{c.define}` (`KernelDims.{c.method.__name__}`)", "", c.doc, ""]
    return "\n".join(lines)


def check_supported(cfg: ModelConfig) -> None:
    """Refuse, with the reason, any shape the kernel cannot run exactly."""
    d = cfg.head_dim
    if d % 8 or d > MAX_HEAD_DIM:
        raise UnsupportedModelError(
            f"the monokernel needs head_dim to be a multiple of 8 and at most {MAX_HEAD_DIM}; "
            f"got {d}"
        )
    group = cfg.num_heads // cfg.num_kv_heads
    if d // 8 * group > THREADS:
        raise UnsupportedModelError(
            "the monokernel's long-context attention gives one thread to each 16-byte chunk of "
            f"a query group's outputs, so head_dim / 8 x (heads / kv_heads) must be at most "
            f"{THREADS}; got {d // 8} x {group}"
        )
    for name, size in (
        ("hidden_size", cfg.hidden_size),
        ("intermediate_size", cfg.intermediate_size),
    ):
        if size % 8:
            raise UnsupportedModelError(
                f"the monokernel needs {name} to be a multiple of 8 (16-byte loads); got {size}"
            )


def cache_dir() -> Path:
    from monokernel.weights.default_model import cache_root  # one root for models and kernels

    return cache_root() / "kernels"


def find_nvcc() -> str:
    cand = envs.MONOKERNEL_NVCC or shutil.which("nvcc")
    if not cand:
        cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
        path = Path(cuda_home) / "bin" / "nvcc"
        cand = str(path) if path.is_file() else None
    if not cand:
        raise BackendUnavailableError(
            "the monokernel is built at first use with nvcc, which was not found "
            "(set MONOKERNEL_NVCC or CUDA_HOME, or put nvcc on PATH)"
        )
    return str(cand)


def _flags(debug: bool) -> list[str]:
    flags = ["-O3", "-std=c++17", *ARCH_FLAGS, "-cubin"]
    # Extra flags for experiments, e.g. a smaller "-DMK_ATTN_CHUNK=64" (part of the cache key;
    # a choice's define here replaces the shape's, see KernelDims.choices).
    flags += envs.MONOKERNEL_NVCC_FLAGS.split()
    if debug:
        flags += ["-lineinfo", "-G", "-DMK_DEBUG=1"]
    return flags


def _source_digest() -> str:
    """The decode kernel's sources: its entry and every header. The other .cu files are
    standalone kernels (build_standalone keys them by their own sources), so editing one
    does not rebuild every cached decode kernel."""
    h = hashlib.sha256()
    for f in sorted(CSRC.rglob("*.cu*")):
        if f.suffix == ".cu" and f.name != ENTRY:
            continue
        h.update(str(f.relative_to(CSRC)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def nvcc_command(dims: KernelDims, out: Path, debug: bool = False) -> list[str]:
    flags = _flags(debug)
    base = [f for f in flags if not f.startswith("-D")]
    knobs = [f for f in flags if f.startswith("-D")]
    return [
        find_nvcc(),
        *base,
        "-Xptxas",
        "-v",
        *_defines(dims, knobs),
        "-o",
        str(out),
        str(CSRC / ENTRY),
    ]


def _defines(dims: KernelDims, knobs: Sequence[str]) -> list[str]:
    """The shape's -D defines, a choice among ``knobs`` replacing the shape's value, then the
    other knobs (the probe and debug builds')."""
    shape = dims.defines(knobs)
    names = {d.split("=")[0] for d in shape}
    return [*shape, *(k for k in knobs if k.split("=")[0] not in names)]


def compile_check(
    dims: KernelDims, out: Path, extra: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """Compile the decode kernel for ``dims`` to an object file (no cache, no -Xptxas report,
    MONOKERNEL_NVCC_FLAGS ignored): what the CI tests run to keep every build green without a
    GPU. ``extra``: more nvcc flags; a choice's -D define there replaces the shape's value."""
    knobs = [f for f in extra if f.startswith("-D")]
    cmd = [
        find_nvcc(),
        *ARCH_FLAGS,
        "-c",
        *_defines(dims, knobs),
        *(f for f in extra if not f.startswith("-D")),
        "-o",
        str(out),
        str(CSRC / ENTRY),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def cubin_path(dims: KernelDims, debug: bool | None = None) -> Path:
    if debug is None:
        debug = envs.MONOKERNEL_DEBUG_BUILD
    key = hashlib.sha256(
        "\n".join([_source_digest(), *dims.defines(), *_flags(debug)]).encode()
    ).hexdigest()[:24]
    return cache_dir() / f"mk_decode-{key}.cubin"


def build(dims: KernelDims, debug: bool | None = None) -> Path:
    """The cubin for ``dims``, compiled now unless the cache already holds it."""
    if debug is None:
        debug = envs.MONOKERNEL_DEBUG_BUILD
    if envs.MONOKERNEL_BUILD_LOG is not None:
        log_build(envs.MONOKERNEL_BUILD_LOG, dims, envs.MONOKERNEL_NVCC_FLAGS, debug)
    return compile_cached(
        cubin_path(dims, debug), lambda out: nvcc_command(dims, out, debug), "the monokernel"
    )


def log_build(log: Path, dims: KernelDims, flags: str, debug: bool) -> None:
    """Append a build request to ``log`` (MONOKERNEL_BUILD_LOG): one JSON line, written in one
    append, so the test processes of one run can share a log."""
    line = json.dumps({"dims": dataclasses.asdict(dims), "flags": flags, "debug": debug})
    with open(log, "a") as f:
        f.write(line + "\n")


def read_build_log(log: Path) -> list[tuple[KernelDims, str, bool]]:
    """The distinct build requests in ``log``, in first-seen order: (dims, nvcc flags,
    debug)."""
    seen: dict[str, tuple[KernelDims, str, bool]] = {}
    for n, line in enumerate(log.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            req = (KernelDims(**entry["dims"]), str(entry["flags"]), bool(entry["debug"]))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{log}:{n}: not a build request line ({e}): {line[:120]}") from e
        seen.setdefault(line, req)
    return list(seen.values())


def build_standalone(source: Path, headers: Sequence[Path], stem: str, what: str) -> Path:
    """A standalone cubin (a .cu outside the decode kernel: a benchmark's, or the TP
    prefill's all-reduce): keyed by its source, the headers it includes and the flags,
    compiled now unless the cache holds it."""
    flags = ["-O3", "-std=c++17", *ARCH_FLAGS, "-cubin"]
    text = b"".join(f.read_bytes() for f in (source, *headers))
    key = hashlib.sha256(text + "\n".join(flags).encode()).hexdigest()[:24]
    return compile_cached(
        cache_dir() / f"{stem}-{key}.cubin",
        lambda out: [find_nvcc(), *flags, "-Xptxas", "-v", "-o", str(out), str(source)],
        what,
    )


def compile_cached(target: Path, command: Callable[[Path], list[str]], what: str) -> Path:
    """``target``, compiled by ``command(tmp_path)`` unless it exists already. A file lock
    serialises concurrent builders; the result is renamed into place whole."""
    if target.is_file():
        return target
    verbose = envs.MONOKERNEL_VERBOSE_BUILD
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():  # another process finished it while we waited
            return target
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        cmd = command(tmp)
        if verbose:
            print(f"building {what}:", " ".join(cmd), file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if verbose:
            print(proc.stdout + proc.stderr, file=sys.stderr)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise BackendUnavailableError(
                f"nvcc failed building {what} ({' '.join(cmd)}):\n{proc.stderr[-4000:]}"
            )
        os.replace(tmp, target)
    return target


def main(argv: list[str]) -> int:
    """``--knobs``: print docs/kernel-knobs.md."""
    if argv == ["--knobs"]:
        sys.stdout.write(knobs_markdown())
        return 0
    print("usage: python -m monokernel.kernels.build --knobs", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
