"""What a weight format is: how one [rows, cols] weight matrix is stored for the kernel to
stream, and what each stage needs to know about it.

Every stage that touches a streamed matrix (each layer's wqkv, wo, wgu, wdown and the LM
head) asks the matrix's format instead of assuming bf16:

* ``weights/repack.py`` packs each matrix (``pack``) after fusing and folding it;
* ``runtime/kv_memory.py`` counts what packing allocates (``matrix_bytes``,
  ``packs_in_place``);
* the GPU prefill (``runtime/prefill.py``) multiplies by ``dense(m)``;
* tensor parallelism takes row and column blocks (``slice_rows``, ``slice_cols``);
* the kernel's build picks the C++ type that reads the matrix (``kernel_type``).

Activations, the KV cache, the embedding table (one row gathered a token), norm gains and
biases are not a format's: they stay as they are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True, slots=True, eq=False)
class PackedMatrix:
    """One weight matrix of logical shape [rows, cols] (out x in: y = W x) as the format
    named ``format`` stores it. ``data`` is what the kernel streams (its address goes into
    the kernel's weight table); ``scales`` are the format's side tensors, in the order its
    file documents (none for bf16)."""

    format: str
    rows: int
    cols: int
    data: torch.Tensor
    scales: tuple[torch.Tensor, ...] = ()

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols


class WeightFormat(ABC):
    """One way of storing a weight matrix. A new format is one file in this folder with a
    subclass of this, listed in ``__init__.py``'s registry."""

    name: ClassVar[str]  # as the registry and users spell it
    kernel_type: ClassVar[str]  # the C++ type the kernel's weight view and GEMV take
    # Weights one 16-byte load of a row holds (the C++ type's kPerLoad): the kernel reads a
    # row in whole loads, so a GEMV's input length must be a multiple (build.py checks).
    weights_per_load: ClassVar[int]
    # pack(w) and dense(m) hand back w itself when it is already bf16 and contiguous:
    # repacking allocates nothing for a matrix it neither fuses nor folds, and the prefill
    # reads the matrix without a copy.
    packs_in_place: ClassVar[bool]

    @abstractmethod
    def pack(self, w: torch.Tensor, scales: torch.Tensor | None = None) -> PackedMatrix:
        """w [rows, cols] floating point -> the tensors the kernel streams. ``scales``: a
        scaled format's [rows] scales to use instead of w's own (``row_scales``): tensor
        parallelism packs a rank's column block with the whole rows' scales."""

    def row_scales(self, w: torch.Tensor) -> torch.Tensor | None:
        """The [rows] float32 scales ``pack(w)`` would choose (None: an unscaled format)."""
        return None

    @abstractmethod
    def dense(self, m: PackedMatrix, dtype: torch.dtype | None = None) -> torch.Tensor:
        """m dequantised: the [rows, cols] matrix the kernel multiplies by, in ``dtype``.

        ``None`` is the format's natural dtype, what the prefill's GEMMs read: bf16 (for bf16,
        the stored tensor itself, no copy; float32 where it keeps a float32 matrix, for the
        CPU tests' exact arithmetic). ``torch.float32`` gives a scaled format's values
        exactly (its fp32 scale times the stored weight), which the reference engine
        computes with to match the kernel (weights/quantize.py)."""

    def gemm_operands(
        self, m: PackedMatrix, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(w, s) with m's values = w * s[:, None] (s None: w is m's values): what a GEMM
        multiplies by, then scales its output columns by, so a format whose stored values
        are exact in bf16 is multiplied exactly. Default: ``(dense(m, dtype), None)``."""
        return self.dense(m, dtype), None

    @abstractmethod
    def matrix_bytes(self, rows: int, cols: int) -> int:
        """Device bytes of a packed [rows, cols] matrix, scales included: what the kernel
        reads of it every token and what packing it allocates."""

    @abstractmethod
    def slice_rows(self, m: PackedMatrix, start: int, size: int) -> PackedMatrix:
        """Rows [start, start + size) of m (a rank's output features)."""

    @abstractmethod
    def slice_cols(self, m: PackedMatrix, start: int, size: int) -> PackedMatrix:
        """Columns [start, start + size) of m (a rank's input features)."""


def check_block(m: PackedMatrix, start: int, size: int, axis: str) -> None:
    """Refuse, naming the numbers, a row or column block outside the matrix."""
    extent = m.rows if axis == "rows" else m.cols
    if size < 0 or start < 0 or start + size > extent:
        raise ValueError(
            f"{axis} [{start}, {start + size}) of a [{m.rows}, {m.cols}] {m.format} matrix: "
            f"outside [0, {extent})"
        )
