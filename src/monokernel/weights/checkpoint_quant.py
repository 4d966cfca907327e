"""Quantised checkpoints: what a ``config.json``'s ``quantization_config`` says, and the
weights. Two families are read: FP8 and 4-bit (AWQ, GPTQ).

A checkpoint quantised by its publisher to FP8 stores each quantised linear weight as
float8 (one byte a weight) beside a float32 or bf16 scale tensor; the loader
(safetensors_loader.py) reads both and hands the model ``q * scale`` in the engine's dtype,
so every engine runs it as it runs a bf16 checkpoint, and ``Checkpoint.quantization`` says
``"fp8"``: the engine then streams fp8 on the monokernel by default (runtime/engine.py).

FP8 schemes read (all weight-only, E4M3 values, symmetric, w = q * scale):

- ``quant_method: "fp8"`` with ``weight_block_size: [bm, bn]``: HF's fine-grained FP8
  (transformers' FineGrainedFP8, DeepSeek-V3's and Qwen3-*-FP8's format): one scale per
  bm x bn block, ``<module>.weight_scale_inv`` of shape [ceil(out/bm), ceil(in/bn)];
- ``quant_method: "fp8"`` without a block size: the per-tensor format AutoFP8 wrote and
  vLLM reads (``<module>.weight_scale``, one value);
- ``quant_method: "fbgemm_fp8"``: one scale a row, ``<module>.weight_scale`` [out, 1];
- ``quant_method: "compressed-tensors"`` (llm-compressor) whose config groups quantise
  weights to ``{num_bits: 8, type: "float"}``, strategy ``channel`` ([out, 1]), ``tensor``
  (one value) or ``block`` (``block_structure`` [bm, bn]); ``<module>.weight_scale``.

Activation quantisation (``input_activations``, static ``input_scale`` tensors, FP8 KV-cache
``k_scale``/``v_scale``) is ignored: the engines compute activations and the KV cache in
bf16 or float32, which only removes a rounding the publisher's scheme added. Modules the
config leaves out (``ignore``, ``modules_to_not_convert``: usually the LM head) are stored
unquantised and load as they always did.

A 4-bit checkpoint stores each quantised module as ``qweight`` (eight 4-bit values an
int32), ``qzeros`` (eight zero points an int32) and fp16 ``scales``, one scale and zero point
per group of ``group_size`` input columns, w = s * (q - z). Each module is decoded to a
``GroupQuant`` (weights/group_quant.py: the same bits, unpacked), which the layer linear
weights keep in ``Checkpoint.groups`` (``Checkpoint.quantization`` "int4" when all of them
are 4-bit). Their dense values are what the weights hold for them, as an FP8 module's are,
but made only when read (a LazyWeights: weights/lazy_weights.py), since the monokernel
streams the groups and never reads them; any other module's (a GPTQ LM head) are made at
once. Read:

- ``quant_method: "awq"`` (AutoAWQ, as transformers' AwqConfig writes it): ``bits: 4``,
  ``zero_point: true``, ``version: "gemm"`` (qweight [in, out/8] in AutoAWQ's nibble
  order), ``group_size`` a multiple of 32;
- ``quant_method: "gptq"`` (AutoGPTQ, GPTQModel): ``bits: 4``, ``group_size`` a multiple
  of 32 or -1 (one group a row), ``sym`` true or false, ``checkpoint_format`` "gptq"
  (AutoGPTQ's v1: zero points stored minus one; the default) or "gptq_v2", without
  act-order: ``desc_act: false``, or a ``g_idx`` of arange(in) // group in every module
  (any other is refused when the weights are read; safetensors_loader reads the g_idx
  tensors before any weight).

Modules the config leaves out (``modules_to_not_convert``; the LM head unless GPTQ's
``lm_head``) are stored unquantised and load as they always did.

Everything else (AWQ GEMV or Marlin packing, act-order GPTQ, bitsandbytes, MXFP4, integer
or 4-bit compressed-tensors, ...) is refused by name before a weight is read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from monokernel.errors import TensorShapeError
from monokernel.weights.group_quant import (
    GPTQ_FORMATS,
    GROUP_MULTIPLE,
    GroupQuant,
    from_awq,
    from_gptq,
)
from monokernel.weights.quantize import UnsupportedQuantizationError, is_quantized

# What Checkpoint.quantization says for every scheme read here: the weights are E4M3 bytes,
# which the monokernel's fp8 format streams.
CHECKPOINT_FP8 = "fp8"
FLOAT8_DTYPES: frozenset[torch.dtype] = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
# Our name for a weight's scale: the weight's name plus this (never one of our weight names).
SCALE_SUFFIX = ".scale"
STRATEGIES = ("channel", "tensor", "block")
SUPPORTED = (
    "fp8 (HF fine-grained, block scales; or per-tensor), fbgemm_fp8, compressed-tensors "
    "float8 (channel, tensor or block scales), awq (4-bit, zero point, GEMM packing, "
    "group_size a multiple of 32), gptq (4-bit, sym or not, checkpoint_format gptq or "
    "gptq_v2, group_size a multiple of 32 or -1, without act-order)"
)
# Tensors of the float schemes that describe activations or the KV cache, not weights: the
# engines compute those unquantised, so these are read past. A float scheme is symmetric
# (asymmetric ones are refused below), so a weight_zero_point is all zeros.
ACTIVATION_TENSORS = re.compile(
    r".*\.(input_scale|input_scale_ub|input_zero_point|output_scale|output_zero_point"
    r"|weight_zero_point|k_scale|v_scale|q_scale|kv_scale|prob_scale)$"
)
# compressed-tensors formats that store float8 weights as they are (mixed-precision: each
# group names its own, and the group checks decide).
_CT_FORMATS = ("float-quantized", "naive-quantized", "dense", "mixed-precision")


@dataclass(frozen=True, slots=True)
class CheckpointQuant:
    """How a checkpoint's fp8 weights are scaled."""

    method: str  # quant_method as config.json spells it: fp8, fbgemm_fp8, compressed-tensors
    strategy: str  # channel | tensor | block
    block: tuple[int, int] | None  # (rows, cols) of a block; None unless strategy is block
    scale_suffix: str  # weight_scale | weight_scale_inv: "<module>.<suffix>" is the scale
    # Whether w = q / scale. False for every format read here: HF's weight_scale_inv is,
    # despite its name, multiplied. transformers' FineGrainedFP8 quantiser stores
    # 1 / (448 / amax) = amax / 448 under that name, its FP8Linear multiplies the GEMM's
    # output by it, and DeepSeek-V3's own weight_dequant (the format's origin) computes
    # y = x * s; "inv" names the inverse of the quantising factor 448 / amax.
    scale_is_inverse: bool = False


# Low-bit methods other than the two read: their refusal says which 4-bit formats are.
_LOW_BIT = ("bitsandbytes", "hqq", "aqlm", "exl2", "gptq_marlin", "awq_marlin", "quanto", "eetq")


def _refuse(method: str, detail: str = "", low_bit: bool = False) -> UnsupportedQuantizationError:
    hint = ""
    if low_bit or method.lower() in _LOW_BIT:
        hint = ". 4-bit checkpoints are read in AWQ (GEMM) and GPTQ packing only"
    what = f"checkpoint quantization {method!r}" + (f" ({detail})" if detail else "")
    return UnsupportedQuantizationError(f"{what} is not supported; supported: {SUPPORTED}{hint}")


def _block(value: Any, method: str, key: str) -> tuple[int, int]:
    if isinstance(value, str) and re.fullmatch(r"\d+x\d+", value):
        value = [int(v) for v in value.split("x")]
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise _refuse(method, f"{key}={value!r} is not two positive block sizes")
    return int(value[0]), int(value[1])


def _compressed_tensors(qc: Mapping[str, Any]) -> CheckpointQuant:
    method = "compressed-tensors"
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _refuse(method, "no config_groups")
    schemes: set[tuple[str, tuple[int, int] | None]] = set()
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if weights is None:
            continue  # a group quantising activations only: its weights stay as they are
        if not isinstance(weights, Mapping):
            raise _refuse(method, f"group {name!r} has malformed weights {weights!r}")
        bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
        described = f"weights num_bits={bits} type={kind} strategy={strategy}"
        if bits != 8 or kind != "float" or strategy not in STRATEGIES:
            raise _refuse(method, described, low_bit=isinstance(bits, int) and bits < 8)
        if weights.get("symmetric") is False:
            raise _refuse(method, f"{described}, asymmetric")
        fmt_group = group.get("format")
        if fmt_group is not None and fmt_group not in _CT_FORMATS:
            raise _refuse(method, f"{described}, format {fmt_group!r}")
        block = (
            _block(weights.get("block_structure"), method, "block_structure")
            if strategy == "block"
            else None
        )
        schemes.add((strategy, block))
    if not schemes:
        raise _refuse(method, "no config group quantises weights")
    if len(schemes) > 1:
        raise _refuse(method, f"config groups with different weight schemes {sorted(schemes)}")
    # After the groups, whose num_bits/type/strategy say most about a refused scheme.
    fmt = qc.get("format")
    if fmt is not None and fmt not in _CT_FORMATS:
        raise _refuse(method, f"format {fmt!r}")
    sparsity = qc.get("sparsity_config")
    if isinstance(sparsity, Mapping) and sparsity.get("format", "dense") != "dense":
        raise _refuse(method, f"sparse format {sparsity.get('format')!r}")
    if qc.get("transform_config"):
        # Rotations (SpinQuant, QuIP) folded into the weights need their inverse at run time.
        raise _refuse(method, "with transforms")
    ((strategy, block),) = schemes
    return CheckpointQuant(method, strategy, block, "weight_scale")


# --------------------------------------------------------------------------- 4-bit

# The tensors of a 4-bit module, "<module>.<part>"; g_idx only in GPTQ (and optional).
PACKED_PARTS: tuple[str, ...] = ("qweight", "qzeros", "scales", "g_idx")
REQUIRED_PARTS: tuple[str, ...] = ("qweight", "qzeros", "scales")


@dataclass(frozen=True, slots=True)
class Int4Quant:
    """How a checkpoint's 4-bit modules are packed (the module docstring's AWQ and GPTQ)."""

    method: str  # awq | gptq
    group: int  # input columns a group; -1 (GPTQ): one group a row
    sym: bool = False  # GPTQ: the zero point is 8, whatever qzeros holds
    checkpoint_format: str = "gemm"  # awq: gemm; gptq: gptq (v1 zeros) | gptq_v2
    desc_act: bool = False  # GPTQ: act-order was asked for (g_idx then decides)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bits(qc: Mapping[str, Any], method: str, *keys: str) -> None:
    bits = next((qc[k] for k in keys if k in qc), None)
    if bits != 4:
        raise _refuse(method, f"bits={bits!r}; 4 is read")


def _group_size(value: Any, method: str, whole_row: bool) -> int:
    if whole_row and value == -1:
        return -1
    if not _is_int(value) or value <= 0 or value % GROUP_MULTIPLE:
        raise _refuse(
            method, f"group_size={value!r} is not a positive multiple of {GROUP_MULTIPLE}"
        )
    return int(value)


def _awq(qc: Mapping[str, Any], method: str) -> Int4Quant:
    # AutoAWQ's own quant_config.json spells bits and group size w_bit and q_group_size.
    _bits(qc, method, "bits", "w_bit")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(method, f"version {version!r}; the GEMM packing is read")
    if qc.get("zero_point", True) is not True:
        raise _refuse(method, "without zero points (zero_point=false)")
    backend = str(qc.get("backend") or "autoawq").lower()
    if backend != "autoawq":  # llm-awq's own packing differs from AutoAWQ's
        raise _refuse(method, f"backend {backend!r}; AutoAWQ's packing is read")
    group = qc.get("group_size", qc.get("q_group_size"))
    return Int4Quant("awq", _group_size(group, method, whole_row=False))


def _gptq(qc: Mapping[str, Any], method: str) -> Int4Quant:
    _bits(qc, method, "bits")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if qc.get("is_marlin_format"):
        fmt = "marlin"
    if fmt not in GPTQ_FORMATS:
        raise _refuse(method, f"checkpoint_format {fmt!r}; read: {', '.join(GPTQ_FORMATS)}")
    if qc.get("dynamic"):
        raise _refuse(method, "with per-module overrides (dynamic)")
    pack = str(qc.get("pack_dtype") or "int32").lower().removeprefix("torch.")
    if pack != "int32":
        raise _refuse(method, f"pack_dtype {pack!r}; int32 words are read")
    sym = qc.get("sym", True)
    desc_act = qc.get("desc_act", False)
    group = _group_size(qc.get("group_size"), method, whole_row=True)
    return Int4Quant("gptq", group, sym is not False, fmt, desc_act is True)


def packed_shapes(quant: Int4Quant, qweight_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Every part's shape for a module whose qweight has ``qweight_shape``, and under
    "weight" the [out, in] it decodes to; {} when no [out, in] fits (qweight not 2-D, or
    the group does not divide the input size)."""
    if len(qweight_shape) != 2:
        return {}
    rows, words = qweight_shape
    out, inp = (words * 8, rows) if quant.method == "awq" else (words, rows * 8)
    group = inp if quant.group == -1 else quant.group
    if inp % group or group % GROUP_MULTIPLE:
        return {}
    return {
        "weight": (out, inp),
        "qweight": tuple(qweight_shape),
        "qzeros": (inp // group, -(-out // 8)),
        "scales": (inp // group, out),
        "g_idx": (inp,),
    }


def decode_int4(parts: Mapping[str, torch.Tensor], quant: Int4Quant) -> GroupQuant:
    """One module's packed tensors (PACKED_PARTS -> tensor) as a GroupQuant [out, in]."""
    if quant.method == "awq":
        return from_awq(parts["qweight"], parts["qzeros"], parts["scales"], quant.group)
    return from_gptq(
        parts["qweight"],
        parts["qzeros"],
        parts["scales"],
        parts.get("g_idx"),
        quant.group,
        quant.sym,
        quant.checkpoint_format,
    )


def parse_quantization_config(
    hf_config: Mapping[str, Any],
) -> CheckpointQuant | Int4Quant | None:
    """The scheme of a checkpoint's ``config.json`` (as a dict); None when it has no
    ``quantization_config``. UnsupportedQuantizationError for a scheme not read here."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping) or not isinstance(qc.get("quant_method"), str):
        raise _refuse("unknown", f"quantization_config without a quant_method: {qc!r}")
    method: str = qc["quant_method"]
    key = method.lower()
    if key == "fp8":
        if qc.get("weight_block_size") is None:
            return CheckpointQuant(method, "tensor", None, "weight_scale")
        block = _block(qc["weight_block_size"], method, "weight_block_size")
        return CheckpointQuant(method, "block", block, "weight_scale_inv")
    if key == "fbgemm_fp8":
        return CheckpointQuant(method, "channel", None, "weight_scale")
    if key == "compressed-tensors":
        return _compressed_tensors(qc)
    if key == "awq":
        return _awq(qc, method)
    if key == "gptq":
        return _gptq(qc, method)
    raise _refuse(method)


def scaled_weight(hf_name: str, quant: CheckpointQuant) -> str | None:
    """The HF name of the weight that ``hf_name`` is the scale of, or None when it is no
    scale: ``model.layers.0.self_attn.q_proj.weight_scale_inv`` -> ``...q_proj.weight``."""
    suffix = "." + quant.scale_suffix
    return hf_name[: -len(suffix)] + ".weight" if hf_name.endswith(suffix) else None


def expected_scale_shape(
    weight_shape: tuple[int, ...], quant: CheckpointQuant
) -> tuple[int, ...] | None:
    """The scale shape ``quant`` gives a weight of ``weight_shape`` ([out, in]); None for
    a weight that is not a matrix. Per tensor: (); a scale of one element fits too."""
    if len(weight_shape) != 2:
        return None
    out, inp = weight_shape
    if quant.strategy == "channel":
        return (out, 1)
    if quant.strategy == "tensor":
        return ()
    assert quant.block is not None
    bm, bn = quant.block
    return (math.ceil(out / bm), math.ceil(inp / bn))


def check_scale_shape(
    name: str, weight_shape: tuple[int, ...], scale_shape: tuple[int, ...], quant: CheckpointQuant
) -> None:
    """TensorShapeError naming ``name`` and both shapes when the scale does not fit."""
    want = expected_scale_shape(weight_shape, quant)
    n = math.prod(scale_shape)
    if want is None:
        ok = False
    elif quant.strategy == "channel":
        ok = scale_shape in (want, want[:1])  # [out, 1] as written, or [out]
    elif quant.strategy == "tensor":
        ok = n == 1 and len(scale_shape) <= 2
    else:
        ok = scale_shape == want
    if not ok:
        raise TensorShapeError(
            f"tensor {name}: a {quant.strategy} scale of shape {scale_shape} does not fit the "
            f"weight of shape {weight_shape} ({quant.method} checkpoint; expected "
            f"{want if want is not None else 'a 2-D weight'})"
        )


def factor(scale: torch.Tensor, quant: CheckpointQuant, device: torch.device) -> torch.Tensor:
    """The float32 factor a stored scale tensor stands for: what q is multiplied by."""
    s = scale.to(device=device, dtype=torch.float32)
    return 1.0 / s if quant.scale_is_inverse else s


@dataclass(frozen=True, slots=True)
class Fp8Blocks:
    """An FP8 checkpoint's block scales of its layer linear weights (``factor``'s float32
    [ceil(out / rows), ceil(in / cols)] a weight, our names), kept beside the dequantised
    weights so that the monokernel streams the checkpoint's own E4M3 values with them
    (weights/formats/fp8.py's block scales) rather than re-quantising each row."""

    rows: int  # a block's rows (bm) and columns (bn)
    cols: int
    scales: Mapping[str, torch.Tensor]

    def row_scales(self, name: str, out: int) -> torch.Tensor:
        """Weight ``name``'s scales a row and block of columns: [out, ceil(in / cols)]."""
        return self.scales[name].repeat_interleave(self.rows, dim=0)[:out]

    def to(self, device: torch.device) -> Fp8Blocks:
        return Fp8Blocks(self.rows, self.cols, {k: v.to(device) for k, v in self.scales.items()})


E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantize_blocks(w: torch.Tensor, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] as a fine-grained FP8 publisher stores it: the E4M3 values and the
    float32 scales [ceil(rows / bm), ceil(cols / bn)], each bm x bn block's largest
    magnitude onto 448 (partial last blocks their own; a block of zeros scale 1)."""
    rows, cols = w.shape
    wf = torch.nn.functional.pad(w.float(), (0, -cols % bn, 0, -rows % bm))
    amax = wf.abs().view(wf.shape[0] // bm, bm, wf.shape[1] // bn, bn).amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (w.float() / block_scales(s, bm, bn, rows, cols)).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), s


def block_scales(s: torch.Tensor, bm: int, bn: int, rows: int, cols: int) -> torch.Tensor:
    """Block scales [ceil(rows / bm), ceil(cols / bn)] as one a weight, [rows, cols]."""
    return s.repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]


def fp8_block_checkpoint(
    weights: Mapping[str, torch.Tensor],
    bm: int,
    bn: int,
    dtype: torch.dtype | None = torch.float32,
) -> tuple[dict[str, torch.Tensor], Fp8Blocks]:
    """What loading a fine-grained FP8 checkpoint of ``weights`` gives: each layer linear
    weight quantised in bm x bn blocks (quantize_blocks) and handed over dequantised in
    ``dtype`` (None: each weight's own), the rest as they are, and the block scales. For
    tests and the bench's ``fp8-block`` engines (random weights as an FP8 checkpoint would
    hold them)."""
    dense, scales = dict(weights), {}
    for name in [n for n in weights if is_quantized(n)]:
        q, scales[name] = quantize_blocks(weights[name], bm, bn)
        full = q.float() * block_scales(scales[name], bm, bn, *q.shape)
        dense[name] = full.to(dtype or weights[name].dtype)
    return dense, Fp8Blocks(bm, bn, scales)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, quant: CheckpointQuant, name: str = "weight"
) -> torch.Tensor:
    """``q * scale`` as float32 [out, in], on q's device: each float8 value times its row's,
    the tensor's or its block's scale (a partial last block uses the same scale). ``name``
    names the tensor in the error for a scale whose shape does not fit."""
    check_scale_shape(name, tuple(q.shape), tuple(scale.shape), quant)
    s = factor(scale, quant, q.device)
    # In place on the one float32 copy: the working memory is a single matrix's float32,
    # not also a full-size expanded scale.
    w = q.to(torch.float32, copy=True)  # never the caller's tensor, whatever its dtype
    out, inp = w.shape
    if quant.strategy == "channel":
        return w.mul_(s.reshape(-1, 1))
    if quant.strategy == "tensor":
        return w.mul_(s.reshape(()))
    assert quant.block is not None
    bm, bn = quant.block
    rows = s.repeat_interleave(bm, dim=0)[:out]  # [out, blocks across]
    full = inp // bn
    if full:
        w[:, : full * bn].view(out, full, bn).mul_(rows[:, :full, None])
    if inp > full * bn:
        w[:, full * bn :].mul_(rows[:, full : full + 1])
    return w
