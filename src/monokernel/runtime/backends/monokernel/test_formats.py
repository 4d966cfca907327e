"""The monokernel streaming quantised weights (--quantize fp8 / int8 / int4) against the
float32 reference on the dequantised weights: the same values the kernel multiplies by, so
what is left is the kernel's arithmetic (teacher-forced logits), and free-running greedy;
and the real default model decoding from its own Q4_1 blocks against HF transformers.

The quantised matrices come from the code that quantises at load (weights/formats): the
kernel's from its repacking, the reference's from ``fake_quantize`` on the checkpoint's.

GPU tests (marker ``gpu``): a Hopper GPU with room for the shape's bf16 weights, their
quantised copy and one float32 matrix at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import pytest
import torch

from monokernel import envs
from monokernel.kernels.build import KernelDims
from monokernel.models.config import ModelConfig
from monokernel.models.shapes import SHAPES
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.sampling import SamplingParams
from monokernel.testing.gpu_models import default_model_on_gpu, hopper_with, random_ids
from monokernel.testing.oracle import assert_greedy_matches, assert_logits_match, peaked
from monokernel.weights.checkpoint_quant import fp8_block_checkpoint
from monokernel.weights.group_quant import GroupQuant
from monokernel.weights.names import Weights
from monokernel.weights.quantize import DequantizedView
from monokernel.weights.random_weights import random_weights

PROMPT, STEPS = 64, 256

# An odd shape whose rows are whole 16-byte loads of a 1-byte format (SHAPES' "odd" is not:
# hidden 520): odd head count and size, one KV head, biases and q/k norms, an odd vocabulary.
ODD16: ModelConfig = dataclasses.replace(
    SHAPES["odd"],
    hidden_size=528,
    intermediate_size=1424,
    num_heads=5,
    num_kv_heads=1,
    head_dim=112,
)
# An odd shape for int4, whose rows are whole 32-column groups: int4_group picks groups of
# 32 for it (q heads x head_dim 672), the real shapes get 128.
ODD32: ModelConfig = dataclasses.replace(
    SHAPES["odd"],
    hidden_size=640,
    intermediate_size=1408,
    num_heads=7,
    num_kv_heads=1,
    head_dim=96,
)
# An odd shape in int4 tiles (csrc/gemv_tiles.cuh: inputs whole 64-column loads, the fused
# QKV rows whole 16-row tiles): groups of 64, one KV head, odd tile counts.
ODD64: ModelConfig = dataclasses.replace(
    SHAPES["odd"],
    hidden_size=704,
    intermediate_size=1472,
    num_heads=5,
    num_kv_heads=1,
    head_dim=128,
)
CONFIGS: dict[str, ModelConfig] = {
    "llama-3.1-8b": SHAPES["llama-3.1-8b"],
    "qwen2.5-coder-1.5b": SHAPES["qwen2.5-coder-1.5b"],
    "odd16": ODD16,
    "odd32": ODD32,
    "odd64": ODD64,
}
# The formats each shape runs in (odd16's rows are not whole int4 groups, odd32's are);
# "int4-tiles", "fp8-tiles": with MONOKERNEL_WEIGHT_LAYOUT=tiles (the 8B shape streams both
# in tiles already).
FORMATS: dict[str, tuple[str, ...]] = {
    "llama-3.1-8b": ("fp8", "int8", "int4"),
    "qwen2.5-coder-1.5b": ("fp8", "int8", "int4", "int4-tiles", "fp8-tiles"),
    "odd16": ("fp8", "int8"),
    "odd32": ("int4",),
    "odd64": ("int4-tiles", "fp8-tiles"),
}


def layout(fmt: str) -> tuple[str, str]:
    """A case's --quantize method and its MONOKERNEL_WEIGHT_LAYOUT."""
    return (fmt.removesuffix("-tiles"), "tiles") if fmt.endswith("-tiles") else (fmt, "auto")


def _needs(shape: str) -> pytest.MarkDecorator:
    gib = 2 * 2 * CONFIGS[shape].num_parameters() / 2**30 + 8
    return pytest.mark.skipif(not hopper_with(gib), reason=f"needs a Hopper GPU, {gib:.0f} GiB")


CASES = [
    pytest.param(shape, fmt, marks=_needs(shape)) for shape in CONFIGS for fmt in FORMATS[shape]
]


@pytest.mark.gpu
@pytest.mark.parametrize(("shape", "fmt"), CASES)
def test_teacher_forced_logits(shape: str, fmt: str) -> None:
    """Rel L2 of the logits <= 1e-2 at every one of 256 steps after a 64-token prompt."""
    from monokernel.runtime.backends.monokernel import MonokernelBackend

    cfg, dev = CONFIGS[shape], torch.device("cuda")
    weights = random_weights(cfg, device=dev, seed=31)
    seq = random_ids(PROMPT + STEPS, cfg.vocab_size, seed=32)
    fmt, weight_layout = layout(fmt)
    # int4's values (a * q + b) are not bf16 numbers, as fp8's and int8's stored values are:
    # the bf16 prefill would multiply the prompt by them rounded, so it runs in fp32 here and
    # what is compared is the kernel's arithmetic (weights/formats/int4.py says so).
    precision = "fp32" if fmt == "int4" else None
    with envs.overridden(MONOKERNEL_WEIGHT_LAYOUT=weight_layout):
        mk = MonokernelBackend(
            cfg, weights, PROMPT + STEPS, dev, quantize=fmt, prefill_precision=precision
        )
    assert mk.kernel.packed.format == fmt and mk.kernel.packed.head_format == "bf16"
    tiled = fmt in ("int4", "fp8") and (weight_layout == "tiles" or shape == "llama-3.1-8b")
    assert bool(mk.kernel.dims.weight_tiles) == tiled  # the 8B shape: tiles by default
    got = mk.teacher_forced_logits(seq[:PROMPT], seq[PROMPT:])  # [STEPS, V]
    mk.close()
    del mk
    assert_logits_match(cfg, DequantizedView(weights, fmt), seq, PROMPT, got, f"{shape} {fmt}")


# The 1B with an intermediate size of 7,168: the down projection's 16 warps a tile own slices
# of 448 columns, 3.5 groups of 128, which the rule takes (its one round of tiles ends at half
# the columns of 8 warps'), its input streamed.
MID_GROUP_1B: ModelConfig = dataclasses.replace(SHAPES["llama-3.2-1b"], intermediate_size=7168)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("fmt", "cfg"),
    [("int4", SHAPES["llama-3.2-1b"]), ("fp8", SHAPES["llama-3.2-1b"]), ("int4", MID_GROUP_1B)],
    ids=["int4", "fp8", "int4-mid-group"],
)
@pytest.mark.skipif(not hopper_with(16), reason="needs a Hopper GPU, 16 GiB")
def test_streamed_down_input_gives_the_same_bits(fmt: str, cfg: ModelConfig) -> None:
    """E's input streamed warp by warp (MK_E_STREAM: the late columns fetched after E's first
    batches, D's tiles in TilesTailsLast's order) changes when the inputs are read, not what
    is summed: 64 teacher-forced steps give the logits of the build that waits for the whole
    vector, bit for bit. The 1B in tiles: E's 16 warps each own a slice of two batches (of
    seven, starting inside groups of 128, with an intermediate size of 7,168)."""
    from monokernel.runtime.backends.monokernel import MonokernelBackend

    dev, steps = torch.device("cuda"), 64
    weights = random_weights(cfg, device=dev, seed=41)
    seq = random_ids(PROMPT + steps, cfg.vocab_size, seed=42)
    got = []
    for flags in ("", "-DMK_E_STREAM=0"):
        with envs.overridden(MONOKERNEL_WEIGHT_LAYOUT="tiles", MONOKERNEL_NVCC_FLAGS=flags):
            mk = MonokernelBackend(cfg, weights, PROMPT + steps, dev, quantize=fmt)
            streamed = mk.kernel.dims.choices()["MK_E_STREAM"]
            assert mk.kernel.dims.choices()["MK_SPLIT_E"] == 16
        assert streamed == (0 if flags else 1)
        got.append(mk.teacher_forced_logits(seq[:PROMPT], seq[PROMPT:]))
        mk.close()
        del mk
    assert torch.equal(got[0], got[1])


@pytest.mark.gpu
@pytest.mark.skipif(not hopper_with(16), reason="needs a Hopper GPU, 16 GiB")
def test_int4_tile_slices_starting_inside_a_group() -> None:
    """int4 in groups of 128 split over warps whose slices start inside a group (csrc/gemv.cuh
    slice_phase: a slice's first load takes its own pair): the 1.5B in tiles with QKV, O and
    gate/up at 8 warps a tile (192 columns, 1.5 groups) and the down projection at 4 (2,240,
    17.5 groups); rel L2 of the logits <= 1e-2 at every one of 256 teacher-forced steps."""
    from monokernel.runtime.backends.monokernel import MonokernelBackend

    cfg, dev = CONFIGS["qwen2.5-coder-1.5b"], torch.device("cuda")
    weights = random_weights(cfg, device=dev, seed=31)
    seq = random_ids(PROMPT + STEPS, cfg.vocab_size, seed=32)
    flags = "-DMK_TILE_SPLIT_A=8 -DMK_TILE_SPLIT_C=8 -DMK_TILE_SPLIT_D=8 -DMK_SPLIT_E=4"
    with envs.overridden(MONOKERNEL_WEIGHT_LAYOUT="tiles", MONOKERNEL_NVCC_FLAGS=flags):
        mk = MonokernelBackend(
            cfg, weights, PROMPT + STEPS, dev, quantize="int4", prefill_precision="fp32"
        )
        got_splits = [mk.kernel.dims.choices()[k] for k in ("MK_TILE_SPLIT_A", "MK_SPLIT_E")]
    assert mk.kernel.dims.weight_group == 128 and got_splits == [8, 4]
    got = mk.teacher_forced_logits(seq[:PROMPT], seq[PROMPT:])
    mk.close()
    del mk
    assert_logits_match(
        cfg, DequantizedView(weights, "int4"), seq, PROMPT, got, "1.5B int4 mid-group slices"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("int4_layout", ["tiles", "rows"])
@pytest.mark.skipif(not hopper_with(16), reason="needs a Hopper GPU, 16 GiB")
def test_teacher_forced_logits_from_groups_of_32(int4_layout: str) -> None:
    """A 4-bit checkpoint's groups of 32 (GGUF Q4_0/Q4_1/Q4_K's; --quantize never picks 32
    where the sizes are whole 64-column tiles), in both layouts: rel L2 <= 1e-2 against the
    reference on the groups' own values. In tiles a load then carries two group pairs."""
    from monokernel.weights.group_quant import quantize_rtn
    from monokernel.weights.quantize import is_quantized

    cfg = CONFIGS["qwen2.5-coder-1.5b"]
    weights = random_weights(cfg, device=torch.device("cuda"), seed=35)
    seq = random_ids(PROMPT + STEPS, cfg.vocab_size, seed=36)
    groups = {k: quantize_rtn(v, 32) for k, v in weights.items() if is_quantized(k)}
    dims, got, ref = logits_from_groups(cfg, weights, groups, "int4", seq, int4_layout)
    assert dims.weight_group == 32
    assert bool(dims.weight_tiles) == (int4_layout == "tiles")
    assert_logits_match(cfg, ref, seq, PROMPT, got, f"groups of 32, {int4_layout}")


def logits_from_groups(
    cfg: ModelConfig,
    weights: Weights,
    groups: Mapping[str, GroupQuant],
    quantize: str,
    seq: list[int],
    weight_layout: str = "auto",
) -> tuple[KernelDims, torch.Tensor, Weights]:
    """The monokernel streaming a checkpoint's own ``groups`` (as ``quantize``), its prefill
    in fp32 (the groups' values are not bf16 numbers): its build's dims, its teacher-forced
    logits over ``seq`` after PROMPT tokens, and the weights with the groups' values that
    the reference computes with."""
    from monokernel.runtime.backends.monokernel import MonokernelBackend

    with envs.overridden(MONOKERNEL_WEIGHT_LAYOUT=weight_layout):
        mk = MonokernelBackend(
            cfg, weights, PROMPT + STEPS, torch.device("cuda"), quantize=quantize,
            groups=groups, prefill_precision="fp32",
        )  # fmt: skip
    dims = mk.kernel.dims
    got = mk.teacher_forced_logits(seq[:PROMPT], seq[PROMPT:])
    mk.close()
    del mk
    return dims, got, {k: groups[k].dense() if k in groups else v for k, v in weights.items()}


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("shape", "group"),
    [
        pytest.param("llama-3.1-8b", 16, marks=_needs("llama-3.1-8b")),
        pytest.param("qwen2.5-coder-1.5b", 32, marks=_needs("qwen2.5-coder-1.5b")),
        pytest.param("odd64", 16, marks=_needs("odd64")),
        pytest.param("llama-3.1-8b", 0, marks=_needs("llama-3.1-8b"), id="llama-3.1-8b-q4_k_m"),
    ],
)
def test_teacher_forced_logits_from_int8_groups(shape: str, group: int) -> None:
    """A GGUF file's 5- to 8-bit layers (int8 groups of 16, Q6_K's, or 32, Q8_0's and
    Q5_K's; csrc Int8GroupTiles), and a Q4_K_M's mix (group 0 here: int4 tiles in groups of
    32, QKV and down in int8 groups of 16, a stage format each): rel L2 <= 1e-2 against the
    reference on the groups' own values at every one of 256 steps."""
    from monokernel.weights.gguf_8bit import q4_k_m_groups, quantize_groups8
    from monokernel.weights.quantize import is_quantized

    cfg = CONFIGS[shape]
    weights = random_weights(cfg, device=torch.device("cuda"), seed=37)
    seq = random_ids(PROMPT + STEPS, cfg.vocab_size, seed=38)
    if group:
        groups = {k: quantize_groups8(v, group) for k, v in weights.items() if is_quantized(k)}
    else:
        groups = q4_k_m_groups(weights)
    d, got, ref = logits_from_groups(cfg, weights, groups, "int8", seq)
    if group:
        assert (d.weight_format, d.weight_group, d.weight_tiles) == ("int8", group, True)
    else:
        assert d.stage_formats() == [("int4", 32), ("int8", 16), ("int8", 16)] and d.weight_tiles
    label = f"int8 groups of {group}" if group else "q4_k_m"
    assert_logits_match(cfg, ref, seq, PROMPT, got, f"{shape} {label}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("shape", "bm", "bn"),
    [
        pytest.param("llama-3.1-8b", 128, 128, marks=_needs("llama-3.1-8b")),
        pytest.param("qwen2.5-coder-1.5b", 128, 128, marks=_needs("qwen2.5-coder-1.5b")),
        pytest.param("odd64", 48, 64, marks=_needs("odd64")),
    ],
)
def test_teacher_forced_logits_from_fp8_blocks(shape: str, bm: int, bn: int) -> None:
    """A checkpoint's FP8 block scales streamed as they are (Fp8BlockTiles; forced tiles
    below the 8B shape): rel L2 <= 1e-2 against the reference on the checkpoint's own
    dequantised values, the prefill in fp32 (its bf16 one would round q * s)."""
    from monokernel.runtime.backends.monokernel import MonokernelBackend

    cfg, dev = CONFIGS[shape], torch.device("cuda")
    weights, blocks = fp8_block_checkpoint(random_weights(cfg, device=dev, seed=37), bm, bn)
    seq = random_ids(PROMPT + STEPS, cfg.vocab_size, seed=38)
    bf16 = {k: v.bfloat16() for k, v in weights.items()}
    with envs.overridden(MONOKERNEL_WEIGHT_LAYOUT="tiles"):
        mk = MonokernelBackend(
            cfg, bf16, PROMPT + STEPS, dev, quantize="fp8", fp8_blocks=blocks,
            prefill_precision="fp32",
        )  # fmt: skip
    assert mk.kernel.dims.kernel_format() == f"Fp8BlockTiles<{bn}>"
    got = mk.teacher_forced_logits(seq[:PROMPT], seq[PROMPT:])
    mk.close()
    del mk, bf16
    assert_logits_match(cfg, weights, seq, PROMPT, got, f"{shape} fp8 blocks {bm}x{bn}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("shape", "fmt"),
    [c for c in CASES if c.values[0] in ("qwen2.5-coder-1.5b", "odd16", "odd32", "odd64")],
)
def test_greedy_matches_reference(shape: str, fmt: str) -> None:
    """Free-running greedy on peaked random weights: the reference's argmax on the
    dequantised weights at every step but rare near ties (oracle.assert_greedy_matches)."""
    from monokernel.runtime.backends.monokernel import MonokernelBackend

    cfg, dev = CONFIGS[shape], torch.device("cuda")
    weights = peaked(cfg, random_weights(cfg, device=dev, seed=33))
    prompt = random_ids(PROMPT, cfg.vocab_size, seed=34)
    fmt, weight_layout = layout(fmt)
    # int4 with the fp32 prefill, as in test_teacher_forced_logits: the bf16 one multiplies
    # the prompt by the int4 values rounded to bf16, which the reference does not (on odd64
    # that alone flips step 2 by more than the oracle allows, in both int4 layouts).
    precision = "fp32" if fmt == "int4" else None
    with envs.overridden(MONOKERNEL_WEIGHT_LAYOUT=weight_layout):
        mk = MonokernelBackend(
            cfg, weights, PROMPT + STEPS, dev, quantize=fmt, prefill_precision=precision
        )
    request = DecodeRequest(tuple(prompt), SamplingParams(temperature=0.0), STEPS, frozenset())
    got = list(mk.stream(request, CancelToken()))
    mk.close()
    del mk
    assert len(got) == STEPS
    assert_greedy_matches(cfg, DequantizedView(weights, fmt), prompt, got, f"{shape} {fmt}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4", "int4-tiles", "fp8-tiles"])
def test_default_model_greedy(fmt: str) -> None:
    """The real default model (SmolLM2-135M-Instruct, its Q4_1 GGUF dequantised) quantised
    at load: the kernel's greedy tokens are the reference's on the same dequantised values,
    on a chat prompt. Real weights have the outliers random ones lack."""
    if not hopper_with(8):
        pytest.skip("needs a Hopper GPU")
    from monokernel.runtime.backends.monokernel import MonokernelBackend

    cfg, weights, prompt = default_model_on_gpu("Write a Python function that adds.")
    dev = torch.device("cuda")
    fmt, weight_layout = layout(fmt)
    with envs.overridden(MONOKERNEL_WEIGHT_LAYOUT=weight_layout):
        mk = MonokernelBackend(cfg, weights, len(prompt) + STEPS, dev, quantize=fmt)
    request = DecodeRequest(tuple(prompt), SamplingParams(temperature=0.0), STEPS, frozenset())
    got = list(mk.stream(request, CancelToken()))
    mk.close()
    del mk
    assert len(got) == STEPS
    assert_greedy_matches(cfg, DequantizedView(weights, fmt), prompt, got, f"default model {fmt}")


@pytest.mark.gpu
@pytest.mark.parametrize("mix", ["q8_0", "q4_1+q8_0", "q4_1+q8_0-tiles", "16"])
def test_default_model_from_8bit_blocks(mix: str) -> None:
    """The real default model's layers as a GGUF file of 8-bit blocks would load them
    (weights/gguf_8bit.py): every matrix re-encoded as Q8_0 by the gguf package's own
    quantiser ("q8_0"); its Q4_1 blocks with Q8_0 for V and the down projection, as a
    Q4_K_M mixes Q6_K into its Q4_K ("q4_1+q8_0": int8 groups of 32, as int4 streams rows
    here; "-tiles": int4 forced to tiles, so the O and gate/up projections stream their
    Q4_1 blocks as int4 tiles beside QKV and down in int8 groups); its Q4_1 blocks as int8
    groups of 16 (Q6_K's width, "16"). Greedy tokens equal the reference's on the same
    values for 256 steps."""
    if not hopper_with(8):
        pytest.skip("needs a Hopper GPU")
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from monokernel.runtime.backends.monokernel import MonokernelBackend
    from monokernel.weights.gguf_8bit import from_gguf_8bit, uniform_groups

    cfg, weights, prompt = default_model_on_gpu("Write a Python function that adds.")
    ckpt_groups = default_model_groups()
    groups: dict[str, GroupQuant] = {}
    for name, gq in ckpt_groups.items():
        q8 = mix == "q8_0" or (mix.startswith("q4_1") and name.endswith((".wv", ".w_down")))
        if q8:
            w = gq.dense().numpy()
            raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            groups[name] = from_gguf_8bit(torch.from_numpy(np.ascontiguousarray(raw).reshape(-1)),
                                          "Q8_0", tuple(w.shape))  # fmt: skip
        else:
            groups[name] = gq.widened(16) if mix == "16" else gq
    groups = {k: v.to("cuda") for k, v in uniform_groups(groups).items()}
    dev = torch.device("cuda")
    with envs.overridden(MONOKERNEL_WEIGHT_LAYOUT="tiles" if mix.endswith("tiles") else "auto"):
        mk = MonokernelBackend(
            cfg, weights, len(prompt) + STEPS, dev, quantize="int8", groups=groups,
            prefill_precision="fp32",
        )  # fmt: skip
    formats = mk.kernel.dims.stage_formats()
    if mix.endswith("tiles"):
        assert formats == [("int4", 32), ("int8", 32), ("int8", 32)]
    else:
        assert formats == [("int8", 16 if mix == "16" else 32)] * 3
    request = DecodeRequest(tuple(prompt), SamplingParams(temperature=0.0), STEPS, frozenset())
    got = list(mk.stream(request, CancelToken()))
    mk.close()
    del mk
    ref = {k: groups[k].dense() if k in groups else v.float() for k, v in weights.items()}
    assert_greedy_matches(cfg, ref, prompt, got, f"default model, 8-bit blocks {mix}")


def default_model_groups() -> dict[str, GroupQuant]:
    """The default model's own Q4_1 groups (Checkpoint.groups), on the CPU."""
    from monokernel.weights.default_model import default_model_path
    from monokernel.weights.loader import load_checkpoint

    ckpt = load_checkpoint(str(default_model_path(progress=False)))
    assert ckpt.groups is not None
    return dict(ckpt.groups)


CHAT_PROMPTS = (
    "Write a Python function that adds.",
    "What is the capital of France?",
    "Explain recursion in one sentence.",
)


@pytest.mark.gpu
@pytest.mark.parametrize("int4_layout", ["auto", "tiles"])
def test_default_model_from_its_q4_1_blocks_is_hf_transformers(int4_layout: str) -> None:
    """The real default model decoding from its own Q4_1 blocks (Checkpoint.groups, int4 in
    groups of 32, no bf16 detour): greedy tokens equal to HF transformers' on the same GGUF
    dequantised (float32), for 64 tokens on three chat prompts; in the layout the kernel
    picks for it (rows) and in 16-row tiles on the tensor cores."""
    if not hopper_with(8):
        pytest.skip("needs a Hopper GPU")
    pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    from monokernel.errors import ModelNotFoundError
    from monokernel.runtime.backends.monokernel import MonokernelBackend
    from monokernel.tokenizer.tokenizer import Tokenizer
    from monokernel.weights.default_model import default_model_path
    from monokernel.weights.loader import load_checkpoint

    try:
        path = default_model_path(progress=False)
    except ModelNotFoundError as e:
        pytest.skip(f"the default model is not cached and cannot be fetched here: {e}")
    ckpt = load_checkpoint(str(path))
    assert ckpt.quantization == "int4" and ckpt.groups is not None
    tok = Tokenizer.load(ckpt.tokenizer_dir, ckpt.gguf_file)
    dev = torch.device("cuda")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
    ).to(dev)
    weights = {k: v.to(device=dev, dtype=torch.bfloat16) for k, v in ckpt.weights.items()}
    with envs.overridden(MONOKERNEL_WEIGHT_LAYOUT=int4_layout):
        mk = MonokernelBackend(
            ckpt.config,
            weights,
            512,
            dev,
            quantize="int4",
            groups=ckpt.groups,
            prefill_precision="fp32",
        )
    assert mk.kernel.packed.format == "int4"
    n = 64
    try:
        for message in CHAT_PROMPTS:
            prompt = tok.encode_chat([{"role": "user", "content": message}])
            ids = torch.tensor([prompt], device=dev)
            with torch.no_grad():
                out = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    do_sample=False,
                    eos_token_id=sorted(ckpt.eos_token_ids),
                    pad_token_id=ckpt.eos_token_ids[0],
                )
            want = out[0, len(prompt) :].tolist()
            request = DecodeRequest(
                tuple(prompt), SamplingParams(temperature=0.0), n, frozenset(ckpt.eos_token_ids)
            )
            got = list(mk.stream(request, CancelToken()))
            print(f"default model int4 from Q4_1: {message!r}: {len(got)} tokens, hf {len(want)}")
            # Compared up to the EOS, which one side may hand back and the other not.
            eos = ckpt.eos_token_ids
            assert [t for t in got if t not in eos] == [t for t in want if t not in eos], (
                message,
                got,
                want,
            )
    finally:
        mk.close()
