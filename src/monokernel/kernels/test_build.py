"""The build: its defines per shape (the per-shape choices of build.py's CHOICES), the
overrides tests and experiments use, the generated knob list, and the compiles CI keeps
green without a GPU (every shape, TP=2, each choice's other side, the probe and debug
builds)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from monokernel.errors import UnsupportedModelError
from monokernel.kernels import build as kbuild
from monokernel.models.shapes import SHAPES
from monokernel.weights.shard import rank_config, shard_config

KNOBS_DOC = Path(__file__).parents[3] / "docs" / "kernel-knobs.md"
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


def _dims(shape: str, **changes: object) -> kbuild.KernelDims:
    return dataclasses.replace(kbuild.KernelDims.from_config(SHAPES[shape]), **changes)


def _tp_dims(shape: str, tp: int = 2, fmt: str = "bf16", group: int = 0) -> kbuild.KernelDims:
    """One rank's build under tensor parallelism (the backend's rank config)."""
    cfg = rank_config(shard_config(SHAPES[shape], 0, tp))
    dims = kbuild.KernelDims.from_config(cfg)
    return dataclasses.replace(
        dims,
        tp=tp,
        vocab_all=SHAPES[shape].vocab_size,
        weight_format=fmt,
        weight_group=group,
    )


def _define(dims: kbuild.KernelDims, name: str) -> str:
    (value,) = [d.split("=", 1)[1] for d in dims.defines() if d.startswith(f"-D{name}=")]
    return value


@pytest.fixture(autouse=True)
def _no_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MONOKERNEL_NVCC_FLAGS", raising=False)


def test_every_choice_is_a_define_of_every_build() -> None:
    dims = _dims("llama-3.2-1b")
    names = [d.split("=")[0][2:] for d in dims.defines()]
    assert [c.define for c in kbuild.CHOICES] == [n for n in names if n in dict(dims.choices())]
    assert len(set(names)) == len(names)
    assert _define(dims, "MK_WEIGHT_FORMAT") == "Bf16Rows"
    assert _define(dims, "MK_SMEM_BYTES") == str(dims.smem_bytes())
    assert all(c.doc for c in kbuild.CHOICES)


def test_build_without_group_units_is_its_own_cubin() -> None:
    dims = _dims("llama-3.2-1b")
    short = dataclasses.replace(dims, group_units=False)
    assert _define(short, "MK_ATTN_GROUP") == "0" and _define(dims, "MK_ATTN_GROUP") == "1"
    assert kbuild.cubin_path(dims) != kbuild.cubin_path(short)


def test_a_choice_set_in_the_flags_replaces_the_shapes_and_the_host_follows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dims = _dims("llama-3.2-1b")
    assert dims.built_attn_chunk() == dims.attn_chunk() == 512
    splits = 132 // 32  # H100 SMs // heads
    assert dims.head_units_cover(512 * splits, splits)
    assert not dims.head_units_cover(512 * splits + 1, splits)
    assert not dims.head_units_cover(1, 0)  # more heads than SMs: group units only
    monkeypatch.setenv("MONOKERNEL_NVCC_FLAGS", "-DMK_ATTN_CHUNK=32 -DMK_SKEW=1")
    assert dims.built_attn_chunk() == 32
    assert _define(dims, "MK_ATTN_CHUNK") == "32"
    assert dims.smem_bytes() < 195232  # the smaller window's shared memory
    assert dims.head_units_cover(128, splits)
    assert not dims.head_units_cover(129, splits)
    cmd = kbuild.nvcc_command(dims, Path("decode.cubin"))
    assert [f for f in cmd if f.startswith("-DMK_ATTN_CHUNK")] == ["-DMK_ATTN_CHUNK=32"]
    assert "-DMK_SKEW=1" in cmd


@pytest.mark.parametrize(
    "flags",
    ["-DMK_FLOW=0", "-DMK_H=1024", "-DMK_TP=2", "-DMK_ATTN_GROUP=0", "-DMK_D_PRE=x"],
)
def test_flags_that_would_desync_the_host_or_do_nothing_are_refused(
    flags: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MONOKERNEL_NVCC_FLAGS", flags)
    with pytest.raises(ValueError, match=flags.split("=")[0][2:]):
        _dims("llama-3.2-1b").defines()


def test_a_window_larger_than_shared_memory_holds_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MONOKERNEL_NVCC_FLAGS", "-DMK_ATTN_CHUNK=352")
    with pytest.raises(ValueError, match="MK_ATTN_CHUNK=352"):
        _dims("qwen2.5-coder-1.5b").smem_bytes()  # 320 positions fit


def test_per_shape_choices() -> None:
    """Each rule on the shapes it was measured on, and its other side where one exists."""
    llama, qwen, small = _dims("llama-3.2-1b"), _dims("qwen2.5-coder-1.5b"), _dims("qwen3-0.6b")
    assert [d.gate_up_rows_before_input() for d in (llama, qwen, small)] == [2, 2, 1]
    short = [dataclasses.replace(d, group_units=False) for d in (llama, qwen, small)]
    assert [d.gate_up_batch() for d in short] == [5, 3, 4]
    assert llama.gate_up_batch() == qwen.gate_up_batch() == 4
    int4 = [dataclasses.replace(d, weight_format="int4", weight_group=128) for d in (llama, *short)]
    assert [d.gate_up_batch() for d in int4] == [2, 2, 2, 2]
    assert [d.lm_head_drawn_rows() for d in (llama, qwen, small)] == [0, 8, 8]
    assert _tp_dims("qwen2.5-coder-1.5b").lm_head_drawn_rows() == 0
    # The 14B's shape on one GPU, and the same shape as a rank of the 32B at TP=2.
    wide = _dims("qwen2.5-coder-14b")
    narrow = dataclasses.replace(wide, group_units=False)
    assert [wide.gate_up_batch(), narrow.gate_up_batch()] == [5, 6]
    normed = dataclasses.replace(_dims("qwen3-14b"), group_units=False)
    assert normed.gate_up_batch() == 4
    ranks = [
        dataclasses.replace(_tp_dims("qwen2.5-coder-32b"), group_units=g) for g in (True, False)
    ]
    assert [d.gate_up_batch() for d in ranks] == [6, 6]
    # The 32B on one GPU (intermediate 5.4 x hidden: not the 14B's rule) against the 8B.
    big = [_dims("qwen2.5-coder-32b"), _dims("llama-3.1-8b")]
    assert [d.gate_up_batch() for d in big] == [6, 6]  # with group units
    assert _tp_dims("llama-3.1-8b").gate_up_batch() == 6  # a rank's, with group units
    assert [_dims(s).gate_up_batch() for s in ("qwen2.5-coder-7b", "qwen3-8b")] == [6, 6]
    assert [_dims(s).gate_up_batch() for s in ("qwen3-4b", "qwen3-14b")] == [4, 5]
    short = [dataclasses.replace(d, group_units=False) for d in big]
    assert [d.gate_up_batch() for d in short] == [6, 5]
    assert [d.attn_range() for d in (llama, qwen)] == [256, 128]
    assert _define(_tp_dims("qwen2.5-coder-1.5b"), "MK_TP") == "2"


def test_down_split_by_loads_in_flight_and_rows_a_unit() -> None:
    """The fewest warps a row that make a warp's slice one batch of loads, halved where two
    such batches in flight would be more than MAX_DOWN_LOADS a lane, unless the halved split
    leaves units with fewer than two rows (Qwen3-0.6B: 6 loads a lane at 2, but 1,024 rows on
    2,112 one-warp units); then doubled while the rows' slices still fit the grid's warps
    (SmolLM2-135M: 576 rows, 1 -> 2; in int4 and fp8 Qwen3-0.6B too, 1 -> 2; the odd shape's
    175 loads a row do not halve)."""
    want = {"llama-3.2-1b": 8, "qwen2.5-coder-1.5b": 4, "qwen3-0.6b": 2, "odd": 1,
            "smollm2-135m": 2}  # fmt: skip
    for shape, split in want.items():
        dims = _dims(shape)
        assert dims.down_split() == split, shape
        assert _define(dims, "MK_SPLIT_E") == str(split)
        assert (dims.intermediate // 8) % split == 0
    for shape in ("qwen3-0.6b", "smollm2-135m"):
        for fmt, group in (("int4", 128), ("fp8", 0)):
            assert _dims(shape, weight_format=fmt, weight_group=group).down_split() == 2, shape
    # 2,048 rows: a doubled split's slices would not fit 2,112 warps.
    assert _dims("llama-3.2-1b", weight_format="int4", weight_group=128).down_split() == 2


def test_the_knob_list_is_current() -> None:
    assert KNOBS_DOC.read_text() == kbuild.knobs_markdown(), (
        "docs/kernel-knobs.md is stale: run "
        "`python -m monokernel.kernels.build --knobs > docs/kernel-knobs.md`"
    )


@pytest.mark.parametrize(
    ("source", "in_key"),
    [
        ("formats/bf16.cuh", True),  # a header in a subfolder
        (kbuild.ENTRY, True),
        ("prefill_allreduce.cu", False),  # a standalone kernel: keyed by its own sources
    ],
)
def test_the_decode_key_hashes_the_entry_and_every_header(
    source: str, in_key: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    csrc = tmp_path / "csrc"
    shutil.copytree(kbuild.CSRC, csrc)
    monkeypatch.setattr(kbuild, "CSRC", csrc)
    dims = _dims("odd")
    before = kbuild.cubin_path(dims)
    f = csrc / source
    f.write_text(f.read_text() + "\n// changed\n")
    assert (kbuild.cubin_path(dims) != before) == in_key


# ---- compiles (nvcc only, no GPU) ----------------------------------------------------------

COMPILES = [
    # Every shape's two builds the backend loads (with and without group units).
    ("llama-3.2-1b", True, ()),
    ("llama-3.2-1b", False, ()),
    ("qwen2.5-coder-1.5b", True, ()),
    ("qwen2.5-coder-1.5b", False, ()),
    ("qwen3-0.6b", True, ()),
    ("odd", True, ()),
    ("odd", False, ()),
    ("smollm2-135m", True, ()),
    # Hidden > 4096: the 8B and 32B presets' sizes, and the odd one at that width.
    ("llama-3.1-8b", True, ()),
    ("llama-3.1-8b", False, ()),
    ("qwen2.5-coder-32b", False, ()),
    ("odd-wide", True, ()),
    ("odd-wide", False, ()),
    # The per-shape choices' other sides: D's up row after its input and the LM head's tail
    # by tickets (Llama), every LM-head row dealt statically (Qwen), one range per window.
    ("llama-3.2-1b", True, ("-DMK_D_PRE=1", "-DMK_F_DRAWN=8")),
    ("qwen2.5-coder-1.5b", True, ("-DMK_F_DRAWN=0", "-DMK_ATTN_RANGE=0")),
    # The stage-skew probe build (tools/stage_skew.py).
    ("qwen2.5-coder-1.5b", False, ("-DMK_SKEW=1",)),
]


@needs_nvcc
@pytest.mark.parametrize(("shape", "group_units", "flags"), COMPILES)
def test_kernel_compiles(
    shape: str, group_units: bool, flags: tuple[str, ...], tmp_path: Path
) -> None:
    dims = _dims(shape, group_units=group_units)
    proc = kbuild.compile_check(dims, tmp_path / "decode.o", flags)
    assert proc.returncode == 0, proc.stderr


@needs_nvcc
@pytest.mark.parametrize(
    ("shape", "flags", "fmt"),
    [
        ("qwen2.5-coder-1.5b", (), "bf16"),
        ("llama-3.2-1b", (), "bf16"),
        ("llama-3.2-1b", (), "int4"),
        # The LM head's tail by tickets, off in the TP build until measured on two GPUs.
        ("qwen2.5-coder-1.5b", ("-DMK_F_DRAWN=8",), "bf16"),
    ],
)
def test_tp2_kernel_compiles(shape: str, flags: tuple[str, ...], fmt: str, tmp_path: Path) -> None:
    dims = _tp_dims(shape, fmt=fmt, group=128 if fmt == "int4" else 0)
    proc = kbuild.compile_check(dims, tmp_path / "decode.o", flags)
    assert proc.returncode == 0, proc.stderr


@needs_nvcc
@pytest.mark.parametrize(("shape", "group"), [("llama-3.1-8b", 16), ("smollm2-135m", 32)])
def test_int8_group_kernel_compiles(shape: str, group: int, tmp_path: Path) -> None:
    """A GGUF's 5- to 8-bit layers (csrc Int8GroupTiles): tiles whatever the shape."""
    dims = _dims(shape, weight_format="int8", weight_group=group, weight_tiles=None)
    assert dims.weight_tiles and dims.kernel_format() == f"Int8GroupTiles<{group}>"
    assert f"-DMK_SUM_SPLIT={2 if group == 16 else 1}" in dims.defines()
    proc = kbuild.compile_check(dims, tmp_path / "decode.o")
    assert proc.returncode == 0, proc.stderr


def test_group_units_min_range_is_a_choice_an_experiment_may_set() -> None:
    """MK_ATTN_MIN_RANGE: 64 by the rule, any positive count by override."""
    dims = _dims("qwen2.5-coder-32b")
    assert dims.choices()["MK_ATTN_MIN_RANGE"] == 64 and "-DMK_ATTN_MIN_RANGE=64" in dims.defines()
    assert dims.choices(["-DMK_ATTN_MIN_RANGE=16"])["MK_ATTN_MIN_RANGE"] == 16
    with pytest.raises(ValueError, match="MK_ATTN_MIN_RANGE=0"):
        dims.choices(["-DMK_ATTN_MIN_RANGE=0"])


def test_down_input_streams_where_each_warp_owns_a_slice_of_several_batches() -> None:
    """MK_E_STREAM (csrc/flow.cuh TileInputsStreamed) where D and E stream tiles, E's 16
    warps each own one K-slice, and a slice is more than one batch of loads; never where the
    splits taken leave no room for it (csrc/cta.cuh refuses a build where it cannot apply)."""

    def tiles(shape: str, fmt: str, group: int = 0, **changes: object) -> kbuild.KernelDims:
        return _dims(shape, weight_format=fmt, weight_group=group, weight_tiles=True, **changes)

    assert tiles("llama-3.1-8b", "int4", 128).choices()["MK_E_STREAM"] == 1
    assert tiles("llama-3.1-8b", "fp8").choices()["MK_E_STREAM"] == 1
    # The 32B's int4 slices of 27,648 / 16 columns start inside groups of 128 (down_split
    # takes them): the stream with them; an override of 8 warps leaves it no room.
    big = tiles("qwen2.5-coder-32b", "int4", 128)
    assert big.down_split() == 16 and big.choices()["MK_E_STREAM"] == 1
    assert big.choices(["-DMK_SPLIT_E=8"])["MK_E_STREAM"] == 0
    assert big.choices(["-DMK_SPLIT_E=8", "-DMK_E_STREAM=1"])["MK_E_STREAM"] == 0
    assert tiles("qwen2.5-coder-32b", "fp8").choices()["MK_E_STREAM"] == 1
    assert _dims("llama-3.1-8b").choices()["MK_E_STREAM"] == 0  # bf16 rows
    assert tiles("llama-3.2-1b", "int4", 128, positions=2).choices()["MK_E_STREAM"] == 0
    eight = tiles("llama-3.1-8b", "fp8")
    assert eight.choices(["-DMK_E_STREAM=0"])["MK_E_STREAM"] == 0
    assert eight.choices(["-DMK_SPLIT_E=8"])["MK_E_STREAM"] == 0  # E at 8 warps: whole input
    assert _dims("llama-3.1-8b").choices(["-DMK_E_STREAM=1"])["MK_E_STREAM"] == 0


@pytest.mark.parametrize(
    ("shape", "fmt", "group", "split"),
    [
        ("qwen2.5-coder-32b", "int4", 128, 16),  # 2 rounds x 3,456 columns at 8: 3 x 1,728
        ("qwen3-14b", "int4", 128, 16),
        ("qwen2.5-coder-7b", "int4", 128, 8),  # 1 round at 4 and at 8, half the columns
        ("qwen3-4b", "int4", 128, 8),
        ("qwen2.5-coder-14b", "int4", 128, 4),  # 8 ties 4 (1 x 3,456, 2 x 1,728): whole groups
        ("llama-3.1-8b", "int4", 128, 16),  # whole groups at 16 already
        ("qwen2.5-coder-14b", "int4", 64, 8),  # groups of a load: slices of whole groups
        ("qwen2.5-coder-32b", "fp8", 0, 16),
    ],
)
def test_down_split_in_tiles_ends_its_last_round_first(
    shape: str, fmt: str, group: int, split: int
) -> None:
    """Stage E's warps a tile in a tile format: whole groups (tile_split), unless an int4
    split whose slices start inside a group of 128 ends its last round of tiles sooner."""
    dims = _dims(shape, weight_format=fmt, weight_group=group, weight_tiles=True)
    assert dims.down_split() == split
    assert dims.choices()["MK_SPLIT_E"] == split
    assert dims.intermediate % (split * kbuild.INT4_SLICE_COLS) == 0


@needs_nvcc
@pytest.mark.parametrize(("fmt", "group"), [("int4", 128), ("fp8", 0)])
def test_streamed_down_input_kernel_compiles(fmt: str, group: int, tmp_path: Path) -> None:
    """The 8B in tiles: E's input streamed (its static_assert agrees with build.py's rule)."""
    dims = _dims("llama-3.1-8b", weight_format=fmt, weight_group=group, weight_tiles=True)
    assert "-DMK_E_STREAM=1" in dims.defines()
    proc = kbuild.compile_check(dims, tmp_path / "decode.o")
    assert proc.returncode == 0, proc.stderr


def test_verify_pass_builds_and_their_bounds() -> None:
    """A pass build (MK_P) is the step build's dims with more positions: refused past 8, under
    tensor parallelism, and where the positions' vectors leave shared memory no room for the
    step build's window."""
    step = _dims("smollm2-135m")
    four = dataclasses.replace(step, positions=4)
    assert "-DMK_P=4" in four.defines() and "-DMK_P=1" in step.defines()
    assert four.choices() == step.choices()  # the same window, ranges and deals
    for bad in (0, kbuild.MAX_PASS_POSITIONS + 1):
        with pytest.raises(ValueError, match="1 to 8 positions"):
            dataclasses.replace(step, positions=bad)
    with pytest.raises(ValueError, match="on one GPU"):
        dataclasses.replace(_tp_dims("qwen2.5-coder-1.5b"), positions=2)
    with pytest.raises(UnsupportedModelError, match="verify pass of 4 positions"):
        dataclasses.replace(_dims("llama-3.1-8b"), positions=4).defines()


@needs_nvcc
@pytest.mark.parametrize(
    ("fmt", "positions"), [("bf16", 4), ("int4", 4), ("bf16-qk-norm", 4), ("int4", 6)]
)
def test_verify_pass_kernel_compiles(fmt: str, positions: int, tmp_path: Path) -> None:
    """The default model's shape as a pass build of 4 positions, in bf16 rows and in the int4
    groups of 32 its GGUF's Q4_1 layers stream as; with a qk-norm (Qwen3's), whose attention
    path no shape of ours has room to build as a pass; and of 6 positions (K = 5), whose
    GEMV rounds cannot hold 32 / 6 rows (gemv_pass.cuh)."""
    group = 32 if fmt == "int4" else 0
    weights = fmt.removesuffix("-qk-norm")
    dims = _dims("smollm2-135m", weight_format=weights, weight_group=group,
                 positions=positions, qk_norm=fmt.endswith("qk-norm"))  # fmt: skip
    proc = kbuild.compile_check(dims, tmp_path / "decode.o")
    assert proc.returncode == 0, proc.stderr


@needs_nvcc
def test_mixed_stage_kernel_compiles(tmp_path: Path) -> None:
    """A GGUF Q4_K_M's plan (weights/quantize.py GroupsPlan): int4 tiles in groups of 32,
    the fused QKV and the down projection in int8 groups of 16."""
    dims = _dims("llama-3.1-8b", weight_format="int4", weight_group=32, weight_tiles=None,
                 qkv_format="int8", qkv_group=16, down_format="int8", down_group=16)  # fmt: skip
    defines = dims.defines()
    want = ["-DMK_WEIGHT_FORMAT=Int4Tiles<32>", "-DMK_QKV_FORMAT=Int8GroupTiles<16>"]
    want += ["-DMK_DOWN_FORMAT=Int8GroupTiles<16>", "-DMK_SUM_SPLIT=2", "-DMK_TILE_BATCH=3"]
    assert set(want) <= set(defines), defines
    proc = kbuild.compile_check(dims, tmp_path / "decode.o")
    assert proc.returncode == 0, proc.stderr
    with pytest.raises(UnsupportedModelError, match="needs tiles throughout"):
        dataclasses.replace(dims, weight_tiles=False, weight_format="fp8", weight_group=0).defines()


def test_int8_groups_refused_where_the_kernel_has_none() -> None:
    with pytest.raises(UnsupportedModelError, match="int8 groups of 64"):
        _dims("llama-3.1-8b", weight_format="int8", weight_group=64, weight_tiles=None).defines()
    with pytest.raises(UnsupportedModelError, match="16-row tiles"):
        _dims("llama-3.1-8b", weight_format="int8", weight_group=16, weight_tiles=False).defines()


@needs_nvcc
def test_debug_build_compiles(tmp_path: Path) -> None:
    """MONOKERNEL_DEBUG_BUILD's flags: device code with -G and the kernel's asserts."""
    dims = _dims("odd", group_units=False)
    proc = kbuild.compile_check(dims, tmp_path / "decode.o", ("-G", "-DMK_DEBUG=1"))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("tp", [1, 2])
def test_prebuild_makes_the_builds_the_tp_backend_loads(tp: int) -> None:
    """A cache prebuilt for --tp N is hit by the TP backend: each rank's dims are the ones
    its Rank asks kernel_dims for (bf16), so their cache keys agree."""
    from monokernel.kernels.prebuild import _rank_dims
    from monokernel.runtime.backends.monokernel.kernel import kernel_dims

    cfg = SHAPES["qwen2.5-coder-1.5b"]
    for r in range(tp):
        rc = rank_config(shard_config(cfg, r, tp)) if tp > 1 else cfg
        assert _rank_dims(cfg, tp, r) == kernel_dims(rc, tp, "bf16", 0, cfg.vocab_size)
