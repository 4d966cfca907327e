"""Weight formats: how the kernel's streamed matrices are stored (base.py says what a format
knows), and the registry of those that exist. Adding one: a file beside bf16.py with a
``WeightFormat`` subclass, and its class in ``_FORMATS`` below."""

from __future__ import annotations

from monokernel.errors import MonokernelError
from monokernel.weights.formats.base import PackedMatrix, WeightFormat
from monokernel.weights.formats.bf16 import Bf16
from monokernel.weights.formats.fp8 import Fp8Rows
from monokernel.weights.formats.int4 import Int4Groups
from monokernel.weights.formats.int8 import Int8Rows

__all__ = [
    "DEFAULT_FORMAT",
    "FORMATS",
    "PackedMatrix",
    "UnknownWeightFormatError",
    "WeightFormat",
    "get_format",
]

DEFAULT_FORMAT = "bf16"

_FORMATS: tuple[type[WeightFormat], ...] = (Bf16, Fp8Rows, Int8Rows, Int4Groups)
FORMATS: dict[str, WeightFormat] = {cls.name: cls() for cls in _FORMATS}


class UnknownWeightFormatError(MonokernelError, ValueError):
    """A weight format name that no file in weights/formats implements."""


def get_format(name: str) -> WeightFormat:
    """The format called ``name``; UnknownWeightFormatError naming the accepted ones."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise UnknownWeightFormatError(
            f"unknown weight format {name!r}; accepted formats: {', '.join(FORMATS)}"
        )
    return fmt
