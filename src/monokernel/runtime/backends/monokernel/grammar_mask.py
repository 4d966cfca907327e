"""The grammar's mask for a constrained request on the monokernel, handed to the running
kernel one step ahead (kernels/csrc/sampling.cuh ``grammar_allows``).

The kernel never leaves its loop for the grammar: when token s lands on the host, the host
advances the request's matcher (runtime/constrained.py), computes which ids may come at step
s + 1 and copies them into the device buffer while the kernel streams step s + 1's layers;
the LM head of step s + 1 reads them, and waits only if they are late. A step's mask is
[ceil(V/32)] 64-bit words, the allowed bits of ids 32j..32j+31 in the low half and the
step's tag in the high half, so a word is either wholly this step's or visibly not; two
parities let step s + 1's copy land while step s's is still being read.

Buffers (per kernel, allocated on the first constrained request):
    device  [2, W] int64   what the kernel reads (parity = step & 1)
    staging [2, W] int64   pinned host memory the copies read from
"""

from __future__ import annotations

import numpy as np
import torch

_TAG_LIMIT = 2**32 - 1  # u32 tags, never 0 (the zeroed buffer's value)


class GrammarMask:
    """The mask buffers of one kernel on ``device`` for a vocabulary of ``vocab`` ids."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.words = (vocab + 31) // 32
        self.device = device
        self.buffer = torch.zeros((2, self.words), dtype=torch.int64, device=device)
        self._staging = torch.zeros((2, self.words), dtype=torch.int64, pin_memory=True)
        self._host = self._staging.numpy().view(np.uint64)
        self._stream = torch.cuda.Stream(device)
        self._copied = [torch.cuda.Event(), torch.cuda.Event()]
        self._tag = 1  # the next launch's first tag
        self._base = 0

    def begin(self, n_steps: int) -> int:
        """A launch of ``n_steps`` steps: its first tag (Params.mask_tag), never used before."""
        if self._tag + n_steps >= _TAG_LIMIT:
            with torch.cuda.device(self.device):
                self.buffer.zero_()
                torch.cuda.synchronize(self.device)
            self._tag = 1
        self._base = self._tag
        self._tag += n_steps
        return self._base

    def publish(self, step: int, allowed: np.ndarray) -> None:
        """Step ``step``'s mask from ``allowed`` (uint32 words, bit i of word j = id 32j + i;
        words past the buffer's are dropped, missing ones allow nothing)."""
        parity = step & 1
        self._copied[parity].synchronize()  # the copy that last read this staging row
        row = self._host[parity]
        n = min(self.words, allowed.shape[0])
        tag = np.uint64(self._base + step) << np.uint64(32)
        row[:n] = allowed[:n].astype(np.uint64) | tag
        row[n:] = tag
        with torch.cuda.stream(self._stream):
            self.buffer[parity].copy_(self._staging[parity], non_blocking=True)
            self._copied[parity].record(self._stream)
