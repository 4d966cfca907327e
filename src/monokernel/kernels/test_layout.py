"""The one description of what the host and the kernel share (kernels/layout.py): the header
it generates is the one checked in, the ctypes structs follow the description, and the sizes
the host allocates are the ones the kernel indexes."""

from __future__ import annotations

import ctypes
import dataclasses
import re

import pytest

from monokernel.kernels import build as kbuild
from monokernel.kernels import launcher, layout
from monokernel.models.shapes import SHAPES


def test_the_checked_in_header_is_current() -> None:
    assert layout.HEADER.read_text() == layout.header(), (
        "csrc/layout.cuh is stale: run `python -m monokernel.kernels.layout`"
    )


@pytest.mark.parametrize(
    ("struct", "fields"),
    [
        (layout.LayerWeightsStruct, layout.LAYER_WEIGHTS),
        (launcher.KernelParams, layout.PARAMS),
        (launcher.KernelParamsTP, layout.PARAMS + layout.PARAMS_TP),
    ],
)
def test_ctypes_structs_follow_the_description(
    struct: type[ctypes.Structure], fields: tuple[layout.Field, ...]
) -> None:
    want = layout.c_offsets(fields)
    assert {f.name: getattr(struct, f.name).offset for f in fields} == want
    assert ctypes.sizeof(struct) == layout.c_sizeof(fields)
    # The TP tail follows the base struct: nothing of the base moves.
    assert launcher.KernelParamsTP.tp_recv.offset == ctypes.sizeof(launcher.KernelParams)


def test_the_header_declares_every_field_in_order() -> None:
    text = layout.header()
    for name, fields in (("LayerWeights", layout.LAYER_WEIGHTS), ("Params", layout.PARAMS)):
        body = text[text.index(f"struct {name} {{") :]
        body = body[: body.index("};")]
        declared = re.findall(r"^\s+[\w\s*]+?\b(\w+)(?:\[\d+\])?;", body, re.M)
        want = [f.name for f in fields]
        if name == "Params":
            want += [f.name for f in layout.PARAMS_TP]
        assert declared == want


def test_tunables_agree_with_the_kernels_header() -> None:
    """layout.py's copies of the fixed tunables (the header also static_asserts them)."""
    src = (kbuild.CSRC / "tunables.cuh").read_text()
    for name, value in layout.TUNABLES.items():
        m = re.search(rf"constexpr int {name} = (\d+);", src)
        assert m is not None, f"tunables.cuh no longer defines {name}"
        assert int(m.group(1)) == value, name
    m = re.search(r"constexpr int kBatch = (\d+);", src)
    assert m is not None and int(m.group(1)) == kbuild.BATCH


def test_timing_marks_are_named_and_follow_each_other() -> None:
    layers = 16
    slots = [layout.mark_slot(m, layers=layers) for m in layout.STEP_MARKS_BEFORE]
    for layer in range(layers):
        slots += [layout.mark_slot(m, layer) for m in layout.LAYER_MARKS]
    slots += [layout.mark_slot(m, layers=layers) for m in layout.STEP_MARKS_AFTER]
    assert slots == list(range(layout.mark_words(layers)))
    assert layout.mark_words(layers) == 10 * layers + 6
    assert layout.mark_slot("attention.wait", 2) == 1 + 10 * 2 + 3
    assert layout.mark_slot("step.start_ns", layers=layers) == 10 * layers + 5
    assert layout.timing_words(layers, 132) == 10 * layers + 6
    assert layout.timing_words(layers, 132, skew=True) == 10 * layers + 6 + 12 * 132
    assert layout.skew_slot(layers, 3, "o_proj.input") == 10 * layers + 6 + 12 * 3 + 3
    with pytest.raises(KeyError):
        layout.mark_slot("A.work")
    with pytest.raises(ValueError):
        layout.mark_slot("lm_head.work")  # after the layers: needs their count


def test_the_kernel_marks_every_named_point() -> None:
    """Each named mark and skew point is recorded somewhere in the kernel's sources."""
    src = "".join(p.read_text() for p in kbuild.CSRC.rglob("*.cu*") if p.name != "layout.cuh")
    for name in (*layout.LAYER_MARKS, *layout.STEP_MARKS_BEFORE, *layout.STEP_MARKS_AFTER):
        assert f"kMark{layout._camel(name)}" in src, name
    for name in layout.SKEW_NAMES:
        assert f"kSkew{layout._camel(name)}" in src, name


def test_small_buffers() -> None:
    assert layout.barrier_words() == 32 * (1 + 16)
    assert layout.token_words(132) == (264, 132)
    assert layout.host_out_words(10) == 12
    assert layout.tp_reduce_bytes(2, 1536) == 2 * 2 * layout.FLOW_COPIES * 1536 * 4
    logits = 2 * 151936 * 8 + 151936 * 4 + 2 * 151936 * 8
    want = layout.tp_reduce_bytes(2, 1536) + 2 * 2 * 16 + logits
    assert layout.tp_recv_bytes(2, 1536, 151936) == want
    # The raw logits' pairs stay 8-byte aligned after an odd vocabulary's fp32 copy.
    rest = layout.tp_reduce_bytes(2, 8) + 2 * 2 * 16 + 2 * 5 * 8 + 24
    assert layout.tp_recv_bytes(2, 8, 5) - 2 * 5 * 8 == rest


def test_handoff_regions() -> None:
    cfg = SHAPES["qwen2.5-coder-1.5b"]
    regions = layout.handoff_regions(cfg, 132)
    slots = 12 * max(132 // 12, 132 // 2)
    assert [(r.name, r.floats, r.copies) for r in regions] == [
        ("x", 1536, 2),
        ("qkv", 1536 + 2 * 256, 1),
        ("delta", 1536, 2),
        ("attn_out", 1536, 2),
        ("act", 8960, 2),
        ("attn", slots * 128, 2),
        ("attn_ml", slots * 4, 2),
    ]
    # Every region names a Params pointer the kernel reads it through.
    assert {r.name for r in regions} <= {f.name for f in layout.PARAMS}
    # A verify pass's build holds one vector a position in each region's copy.
    three = layout.handoff_regions(cfg, 132, positions=3)
    assert [(r.name, r.floats, r.copies) for r in three] == [
        (r.name, 3 * r.floats, r.copies) for r in regions
    ]
    assert layout.token_words(132, 3) == (2 * 132 * 3, 132)


def test_shared_memory_carve_up() -> None:
    """The carve-up gives the windows and totals the kernel was tuned with."""
    want = {  # shape: (window positions, dynamic shared memory bytes, merged ranges)
        "llama-3.2-1b": (512, 195232, 4),
        "qwen2.5-coder-1.5b": (320, 229920, 5),
        "odd": (480, 230944, 2),
    }
    for shape, (chunk, smem, merge) in want.items():
        dims = kbuild.KernelDims.from_config(SHAPES[shape])
        assert dims.attn_chunk() == chunk, shape
        assert dims.smem_bytes() == smem, shape
        assert dims.merge_ranges() == merge, shape
    # A pass build keeps its step build's window and merged ranges (a pass plans attention as
    # steps do) and holds one input vector a position besides.
    step = kbuild.KernelDims.from_config(SHAPES["smollm2-135m"])
    four = dataclasses.replace(step, positions=4)
    assert (four.attn_chunk(), four.merge_ranges()) == (step.attn_chunk(), step.merge_ranges())
    # xs and xres three more vectors each; stage B's scratch (the largest user of att, which
    # holds D's four inputs too) three more queries' q, k and v; the window three more RoPE
    # rows (D = 64).
    assert four.smem_bytes() - step.smem_bytes() == 4 * 3 * (1536 + 576 + 3 * 64 + 64)
    for cfg in SHAPES.values():
        dims = kbuild.KernelDims.from_config(cfg)
        assert dims.smem_bytes() <= layout.MAX_SMEM_BYTES
        assert layout.smem_bytes(dims, dims.attn_chunk() + 32) > layout.MAX_SMEM_BYTES or (
            dims.attn_chunk() == 512
        )


def test_expressions_render_what_they_evaluate() -> None:
    e = layout.env(kbuild.KernelDims.from_config(SHAPES["llama-3.2-1b"]), 512)
    assert layout.XS(e) == 8192
    assert layout.XS.cxx == "kXsFloats"
    assert dict(layout.NAMED)["kXsFloats"].cxx == "cmax(cmax(MK_H, MK_Q), MK_I)"
    assert (layout.H - (layout.Q - 1)).cxx == "MK_H - (MK_Q - 1)"
    assert (layout.H * (layout.Q // 2))(e) == 2048 * 1024
    assert layout.round4(layout.H + 1)(e) == 2052
    assert layout.WINDOW(e) == 512 * 64 + 64 + 8


def test_logprob_records_hold_what_a_request_may_ask() -> None:
    from monokernel.runtime.backends.monokernel.logit_rules import NEUTRAL
    from monokernel.runtime.sampling import MAX_LOGPROBS

    assert layout.MAX_LOGPROBS == MAX_LOGPROBS
    assert layout.LOGPROB_WORDS == 1 + 2 * MAX_LOGPROBS
    # A launch without penalties or logprobs sets every field they add, to its neutral value.
    names = {f.name for f in layout.PARAMS}
    assert set(NEUTRAL) <= names
    assert {"logit_bias", "seen", "raw_logits", "lp_out", "presence", "min_p"} <= set(NEUTRAL)
