"""The GPUs' side of the tensor-parallel prefill's all-reduce: each rank's partial buffers in
memory its peers can load from, and the kernel that sums them (csrc/prefill_allreduce.cu).

A rank writes a block's partial sum into its buffer for that block (``ATTENTION`` or
``MLP``), then ``reduce_rank`` launches the all-reduce on the rank's current stream: it
signals its peers, waits for theirs and adds every rank's partial to its residual in rank
order. Nothing goes through the host, so a CUDA graph captures a rank's whole prefill
(prefill_tp_graphs.py) and the host issues one replay a rank.

The buffers come from ``cuMemAlloc`` (peer.DeviceBuffer), which the peer access granted per
context covers whatever torch's allocator is set to; torch sees them as tensors without
owning them. Per rank: two [rows, hidden] fp32 buffers and ``SIGNAL_BYTES`` of signal words.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from monokernel.kernels.prefill_allreduce import (
    COUNTS_OFFSET,
    MAX_RANKS,
    SIGNAL_BYTES,
    TIMEOUT_MS,
    PrefillAllReduce,
    PrefillArParams,
    build,
    grid_for,
)

ATTENTION, MLP = 0, 1  # which partial buffer: the attention block's or the MLP block's


def _partials_bytes(rows: int, hidden: int) -> int:
    """One rank's two partial buffers, [2][rows, hidden] fp32."""
    return 2 * rows * hidden * 4


def exchange_bytes(rows: int, hidden: int) -> int:
    """One rank's device memory for the exchange, beyond its own prefill's: both partials
    and its signal words (the memory plan counts it on rank 0)."""
    return _partials_bytes(rows, hidden) + SIGNAL_BYTES


class _Raw:
    """A device pointer as __cuda_array_interface__, for torch.as_tensor (no copy)."""

    def __init__(self, ptr: int, numel: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (numel,),
            "typestr": "<f4",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


class PeerExchange:
    """Every rank's partials and signal words (rank r on ``devices[r]``), for prompts of up
    to ``rows`` tokens a chunk."""

    def __init__(self, devices: Sequence[torch.device], rows: int, hidden: int) -> None:
        # Imported here: the backends' package is the GPU side, and the CPU's ranks never
        # build an exchange.
        from monokernel.runtime.backends.monokernel.peer import (
            DeviceBuffer,
            enable_peer_access,
            keeps_device,
        )

        if not 1 <= len(devices) <= MAX_RANKS:
            raise ValueError(f"the prefill all-reduce takes 1 to {MAX_RANKS} ranks")
        indices = [torch.device(d).index or 0 for d in devices]
        self.rows, self.hidden = rows, hidden
        self.sms = min(torch.cuda.get_device_properties(i).multi_processor_count for i in indices)
        cubin = build()
        with keeps_device():  # the driver calls make each GPU current in turn
            if len(indices) > 1:
                enable_peer_access(indices)
            self._kernels = [PrefillAllReduce(i, cubin) for i in indices]
            self._parts = [DeviceBuffer(i, _partials_bytes(rows, hidden)) for i in indices]
            self._signals = [DeviceBuffer(i, SIGNAL_BYTES) for i in indices]
        self._views = []
        for i, buf in zip(indices, self._parts, strict=True):
            with torch.cuda.device(i):
                flat = torch.as_tensor(_Raw(buf.ptr, 2 * rows * hidden), device=f"cuda:{i}")
            assert flat.data_ptr() == buf.ptr
            self._views.append(flat.view(2, rows, hidden))

    def partial(self, rank: int, which: int, rows: int) -> torch.Tensor:
        """Rank ``rank``'s ``which`` partial buffer for ``rows`` tokens: [rows, hidden]."""
        if not 1 <= rows <= self.rows:
            raise ValueError(f"{rows} rows: the exchange holds 1 to {self.rows}")
        return self._views[rank][which, :rows]

    def reduce_rank(
        self, rank: int, x: torch.Tensor, which: int, bias: torch.Tensor | None = None
    ) -> None:
        """x (rank's residual [rows, hidden] fp32) += every rank's ``which`` partial in rank
        order, then ``bias``; on the current stream of x's device. Every rank must run the
        same exchanges in the same order."""
        rows = x.shape[0]
        if x.dtype != torch.float32 or not x.is_contiguous() or x.shape[1] != self.hidden:
            raise ValueError(f"the residual must be contiguous [rows, {self.hidden}] fp32")
        p = PrefillArParams()
        n = len(self._parts)
        offset = which * self.rows * self.hidden * 4
        for q in range(n):
            p.parts[q] = self._parts[q].ptr + offset
            p.arrivals[q] = self._signals[q].ptr
        p.count = self._signals[rank].ptr + COUNTS_OFFSET
        p.x = x.data_ptr()
        p.bias = 0 if bias is None else bias.data_ptr()
        p.rank, p.nranks, p.rows, p.hidden = rank, n, rows, self.hidden
        p.timeout_ms = TIMEOUT_MS
        stream = torch.cuda.current_stream(x.device).cuda_stream
        grid = grid_for(rows, self.hidden, self.sms)
        self._kernels[rank].launch(grid, p, stream, cooperative=False)

    def reduce_all(
        self, xs: Sequence[torch.Tensor], which: int, bias: torch.Tensor | None = None
    ) -> None:
        """One exchange on every rank (xs[r] on rank r's device), issued from here and
        waited for: for tests and probes; the prefill issues ``reduce_rank`` a rank."""
        for r, x in enumerate(xs):
            with torch.cuda.device(x.device):
                self.reduce_rank(r, x, which, None if bias is None else bias.to(x.device))
        for x in xs:
            torch.cuda.synchronize(x.device)

    def free(self) -> None:
        from monokernel.runtime.backends.monokernel.peer import keeps_device

        self._views = []
        with keeps_device():
            for buf in (*self._parts, *self._signals):
                buf.free()
            for k in self._kernels:
                k.unload()
        self._parts, self._signals, self._kernels = [], [], []
