"""Peer access between the GPUs of one process, and memory peers may store into.

One process drives every GPU (docs/tensor-parallel.md says why), so a peer pointer is just
the buffer's device address once ``cuCtxEnablePeerAccess`` has been called both ways between
the devices' primary contexts (the ones torch uses). Receive buffers come from
``cuMemAlloc`` rather than torch's allocator: peer access granted per context does not
cover virtual-memory allocations (torch with ``expandable_segments``), which would need
``cuMemSetAccess`` per mapping instead.

NVLink multicast (NVLS, ``cuMulticastCreate``, ``multimem`` instructions) is never used, and
``MULTICAST_OFF_ENV`` keeps the libraries we compare against (NCCL, torch symmetric memory,
NVSHMEM) off it too.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from monokernel.errors import BackendUnavailableError
from monokernel.kernels.launcher import check, driver, set_current_context

MULTICAST_OFF_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
_CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704


def multicast_off() -> None:
    """Force the multicast-off settings into this process's environment (inherited by any
    subprocess it starts); set before NCCL or NVSHMEM initialise."""
    os.environ.update(MULTICAST_OFF_ENV)


def _current_context() -> ctypes.c_void_p:
    ctx = ctypes.c_void_p()
    check(driver().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    return ctx


def can_access_peer(device: int, peer: int) -> bool:
    lib = driver()
    dev, other, ok = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    check(lib.cuDeviceGet(ctypes.byref(other), peer), "cuDeviceGet")
    check(lib.cuDeviceCanAccessPeer(ctypes.byref(ok), dev, other), "cuDeviceCanAccessPeer")
    return bool(ok.value)


def enable_peer_access(devices: list[int]) -> None:
    """Let every device in ``devices`` load from and store to every other one; idempotent.
    The caller's current device is kept."""
    with keeps_device():
        _enable_peer_access(devices)


def _enable_peer_access(devices: list[int]) -> None:
    contexts = {}
    for d in devices:
        set_current_context(d)
        contexts[d] = _current_context()
    for d in devices:
        for peer in devices:
            if peer == d:
                continue
            if not can_access_peer(d, peer):
                raise BackendUnavailableError(
                    f"GPU {d} cannot access GPU {peer} peer-to-peer (no NVLink or PCIe P2P "
                    "path); the in-kernel all-reduce needs it between every pair"
                )
            set_current_context(d)
            res = driver().cuCtxEnablePeerAccess(contexts[peer], ctypes.c_uint(0))
            if res != _CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
                check(res, f"cuCtxEnablePeerAccess({d} -> {peer})")


@contextmanager
def keeps_device() -> Iterator[None]:
    """The caller's current CUDA device back afterwards: the ranks' driver calls make each
    GPU's context current in turn, and a caller that runs on "cuda" (no index) afterwards
    must not find itself on the last rank's GPU."""
    prev = torch.cuda.current_device()
    try:
        yield
    finally:
        torch.cuda.set_device(prev)


class DeviceBuffer:
    """``nbytes`` of zeroed device memory on ``device`` from cuMemAlloc (peer-accessible)."""

    def __init__(self, device: int, nbytes: int) -> None:
        lib = driver()
        self.device, self.nbytes = device, nbytes
        set_current_context(device)
        ptr = ctypes.c_uint64()
        check(lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "cuMemAlloc")
        self.ptr = ptr.value
        self.zero()

    def zero(self, nbytes: int | None = None) -> None:
        """Zero the buffer's first ``nbytes`` (all of it by default) and wait for it."""
        lib = driver()
        set_current_context(self.device)
        size = ctypes.c_size_t(self.nbytes if nbytes is None else min(nbytes, self.nbytes))
        check(lib.cuMemsetD8_v2(ctypes.c_uint64(self.ptr), 0, size), "cuMemsetD8")
        check(lib.cuCtxSynchronize(), "cuCtxSynchronize")

    def free(self) -> None:
        if self.ptr:
            set_current_context(self.device)
            driver().cuMemFree_v2(ctypes.c_uint64(self.ptr))
            self.ptr = 0
