"""Weights whose layer matrices are a checkpoint's own groups, made dense when first read.

A checkpoint whose layer matrices stay quantised (``Checkpoint.groups``: a GGUF file's
blocks, kept on the host; an AWQ or GPTQ checkpoint's 4-bit modules, read to the load
device) needs their dense values only on the engines that compute with them (reference,
torch, the CPU's packed step); the monokernel packs the groups themselves and reads
``weights`` only for what is not a layer matrix (embedding, norms, biases, LM head).
Dequantising every matrix at load would hold the model dense for nothing: 130 GB of float32
on the host for a 32B GGUF whose quantised values are 20 GB, or 62 GB of bf16 layers beside
a 32B AWQ checkpoint's 33 GB of groups on the GPU, which no 80 GB card holds.
``LazyWeights`` holds such a matrix as its ``DenseSource`` and makes the tensor on first
read, then keeps it as a dict would (the reference reads every matrix on every forward). Its
names, order and shapes are known without reading.

Code that takes a whole mapping apart without reading it (the engine's cast to the device,
the monokernel's bf16 copy) goes through ``cast_mapping``, so an unread matrix stays unread;
a source cast twice rounds as the tensor would have (``DenseSource.to``), so reading it late
gives the bits that making it first and casting it would have given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass

import torch

from monokernel.weights.group_quant import GroupQuant


@dataclass(frozen=True, slots=True, eq=False)
class DenseSource:
    """How to make one matrix: its groups dequantised in float32, then cast to each dtype of
    ``through`` in turn and last to ``dtype``."""

    gq: GroupQuant
    # scale * (q - zero) where the checkpoint's format dequantises so (GroupQuant.
    # zero_point_dense: its bits); None: scale * q + offset (dense()).
    zero: int | None = None
    dtype: torch.dtype = torch.float32
    device: torch.device | None = None  # None: the groups' own
    # Earlier casts that rounded (an AWQ matrix loaded as bf16, then cast to float32): the
    # values keep those roundings, as a tensor cast the same way keeps them.
    through: tuple[torch.dtype, ...] = ()

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.gq.shape)

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> DenseSource:
        """Tensor.to's signature, so a cast treats a source as it treats a tensor: the
        values are not made, only where and in what they will be."""
        through = self.through
        if dtype is not None and dtype != self.dtype:
            before = through[-1] if through else torch.float32  # dense()'s own values
            if not widens(before, self.dtype):
                through = (*through, self.dtype)
        return dataclasses.replace(
            self,
            dtype=self.dtype if dtype is None else dtype,
            device=self.device if device is None else torch.device(device),
            through=through,
        )

    def dense(self) -> torch.Tensor:
        gq = self.gq
        w = gq.dense() if self.zero is None else gq.zero_point_dense(self.zero)
        for dtype in self.through:
            w = w.to(dtype)
        return w.to(device=self.device, dtype=self.dtype)


def widens(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether every value of dtype ``a`` is one of ``b`` too, so a cast from ``a`` to ``b``
    rounds nothing (bfloat16 or float16 to float32: yes; float32 to bfloat16, bfloat16 to
    float16: no)."""
    if a == b:
        return True
    if not (a.is_floating_point and b.is_floating_point):
        return False
    fa, fb = torch.finfo(a), torch.finfo(b)
    return fb.eps <= fa.eps and fb.max >= fa.max and fb.smallest_normal <= fa.smallest_normal


class LazyWeights(MutableMapping[str, torch.Tensor]):
    """Our names -> tensors, where some are ``DenseSource``s made on first read (and kept).

    Reading an entry (``[]``, ``get``, ``pop``, ``items``, ``values``, ``dict(...)``) makes
    it; names, ``len``, ``in``, ``shape`` and ``unread`` never do. Writing and deleting act
    as on a dict."""

    def __init__(self, entries: Mapping[str, torch.Tensor | DenseSource] | None = None) -> None:
        self._entries: dict[str, torch.Tensor | DenseSource] = dict(entries or {})

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self._entries[name]
        if isinstance(value, DenseSource):
            value = self._entries[name] = value.dense()
        return value

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self._entries[name] = value

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"LazyWeights({len(self)} tensors, {len(self.unread())} not read yet)"

    def clear(self) -> None:
        # MutableMapping's clear pops (reads) every entry in turn.
        self._entries.clear()

    def shape(self, name: str) -> torch.Size:
        """``self[name].shape``, without making an unread entry."""
        return self._entries[name].shape  # a DenseSource knows its shape too

    def unread(self) -> list[str]:
        """The names whose tensor has not been made yet, in order."""
        return [k for k, v in self._entries.items() if isinstance(v, DenseSource)]

    def copy(self) -> LazyWeights:
        """A new mapping of the same entries (tensors shared; unread ones stay unread)."""
        return LazyWeights(self._entries)

    def cast(
        self,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        consume: bool = False,
    ) -> LazyWeights:
        """Every tensor in ``dtype`` on ``device`` (None: as it is), as a new mapping; an
        unread entry is cast when it is read. ``consume``: entries are popped from this one
        as they go, so a tensor cast to the same place is not held twice."""
        out: dict[str, torch.Tensor | DenseSource] = {}
        for name in list(self._entries):
            value = self._entries.pop(name) if consume else self._entries[name]
            out[name] = value.to(device=device, dtype=dtype)
        return LazyWeights(out)


def cast_mapping(
    weights: Mapping[str, torch.Tensor],
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    consume: bool = False,
) -> MutableMapping[str, torch.Tensor]:
    """A new mapping of every tensor of ``weights`` in ``dtype`` on ``device`` (None: as
    it is). A ``LazyWeights``' unread entries stay unread (cast when read); any other
    mapping is read whole into a dict. ``consume``: ``weights`` is emptied as it goes."""
    if isinstance(weights, LazyWeights):
        return weights.cast(dtype, device, consume)
    out: dict[str, torch.Tensor] = {}
    for name in list(weights):
        value = weights.pop(name) if consume else weights[name]  # type: ignore[attr-defined]
        out[name] = value.to(device=device, dtype=dtype)
    return out
