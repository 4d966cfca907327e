"""``--quantize fp8|int8``: a bf16 or float32 checkpoint quantised at load.

The monokernel packs each layer's matrices in the asked-for weight format
(``weights/formats``: one byte a weight, a float32 scale a row) and streams half the bytes
of bf16. The other engines (the reference, torch-compiled) cannot read those bytes; they get
``fake_quantize``'s weights instead: each quantised matrix replaced by the dequantised values
the kernel multiplies by, in the checkpoint's dtype, so every engine computes the same model
and the monokernel's tokens can still be checked against the reference's.

Only the seven matrices of every layer are quantised. The LM head and the embedding keep the
checkpoint's format, as vLLM's ``--quantize`` does: they are the most sensitive matrices
(every logit goes through the head, every token through its embedding row), and the
embedding is a table the kernel gathers one row of a token, not a matrix it streams.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from monokernel.errors import MonokernelError
from monokernel.weights.formats import get_format

QUANTIZE_METHODS: tuple[str, ...] = ("fp8", "int8")  # each also a weight format's name
# A layer's linear weights, as weights/names.py spells them ("layers.{n}.wq", ...).
LINEAR_NAMES: tuple[str, ...] = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


class UnsupportedQuantizationError(MonokernelError, ValueError):
    """A ``--quantize`` method that no weight format implements."""


def check_method(method: str) -> str:
    """``method`` itself, or UnsupportedQuantizationError naming the accepted ones."""
    if method not in QUANTIZE_METHODS:
        raise UnsupportedQuantizationError(
            f"--quantize {method!r} is not supported; choose from {', '.join(QUANTIZE_METHODS)}"
        )
    return method


def is_quantized(name: str) -> bool:
    """Whether ``--quantize`` quantises the tensor called ``name`` (one of a layer's seven
    linear weights)."""
    parts = name.split(".")
    return len(parts) == 3 and parts[0] == "layers" and parts[2] in LINEAR_NAMES


def fake_quantize(
    weights: Mapping[str, torch.Tensor], method: str, consume: bool = False
) -> dict[str, torch.Tensor]:
    """A new dict of ``weights`` where each layer's linear weight w is what the kernel
    multiplies by once w is packed in format ``method``: ``dense(pack(w))`` in w's dtype
    (exact for float32, the reference's precision). Everything else (the embedding, the LM
    head, norms, biases) is the same tensor object, untouched.

    One matrix at a time, so the working memory is one matrix's float32 copy and its packed
    bytes on top of the dicts. ``weights`` is not changed, unless ``consume`` (a dict the
    caller owns, as cast_weights empties its input): each tensor is then popped as it is
    replaced, so the model is held once, not twice.
    """
    fmt = get_format(check_method(method))
    out: dict[str, torch.Tensor] = {}
    for name in list(weights):
        w = weights.pop(name) if consume else weights[name]  # type: ignore[attr-defined]
        out[name] = fmt.dense(fmt.pack(w), dtype=w.dtype) if is_quantized(name) else w
    return out


class DequantizedView(Mapping[str, torch.Tensor]):
    """``weights`` as the float32 reference reads them under ``--quantize method``: each
    layer's matrices through the format's pack and dense in float32 (exactly the values the
    kernel scales its dot products to), everything else in float32, one tensor at a time
    when read (an 8B model's float32 copy would not fit beside the kernel's)."""

    def __init__(self, weights: Mapping[str, torch.Tensor], method: str) -> None:
        self._w, self._fmt = weights, get_format(check_method(method))

    def __getitem__(self, name: str) -> torch.Tensor:
        w = self._w[name]
        if is_quantized(name):
            return self._fmt.dense(self._fmt.pack(w), torch.float32)
        return w.float()

    def __iter__(self) -> Iterator[str]:
        return iter(self._w)

    def __len__(self) -> int:
        return len(self._w)


# The matrices tensor parallelism splits by input column (weights/shard.py): a rank packs
# its block with the whole rows' scales, so TP=N quantises exactly as TP=1 does.
COLUMN_SPLIT: tuple[str, ...] = ("wo", "w_down")


def whole_row_scales(
    weights: Mapping[str, torch.Tensor], method: str, num_layers: int
) -> dict[str, torch.Tensor]:
    """Each layer's column-split matrices' [rows] scales under ``method``, by weight name."""
    fmt = get_format(check_method(method))
    out: dict[str, torch.Tensor] = {}
    for n in range(num_layers):
        for m in COLUMN_SPLIT:
            name = f"layers.{n}.{m}"
            scales = fmt.row_scales(weights[name])
            assert scales is not None, f"{method} is a scaled format"
            out[name] = scales
    return out
