"""Load the built cubin and launch it through the CUDA driver API (ctypes on libcuda).

No torch extension is compiled: the kernel is a plain cubin, so a build takes seconds and
needs no C++ toolchain beside nvcc. torch owns the device memory and the primary context;
this module only loads the module, raises its shared-memory limit, allocates the host-mapped
words the host and the kernel talk through, and does the cooperative launch (which
guarantees every CTA is resident at once, as the grid barrier needs).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from monokernel.errors import BackendUnavailableError
from monokernel.kernels import layout

_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_MEMHOSTALLOC_PORTABLE = 0x01
_CU_MEMHOSTALLOC_DEVICEMAP = 0x02
_CUDA_ERROR_NOT_READY = 600

_lib: ctypes.CDLL | None = None


def driver() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        try:
            _lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise BackendUnavailableError(f"the CUDA driver (libcuda.so.1) is missing: {e}") from e
        check(_lib.cuInit(0), "cuInit")
    return _lib


def check(res: int, what: str) -> None:
    if res == 0:
        return
    msg = ctypes.c_char_p()
    lib = _lib
    if lib is not None:
        lib.cuGetErrorString(res, ctypes.byref(msg))
    text = msg.value.decode() if msg.value else "unknown error"
    raise RuntimeError(f"{what} failed: CUDA error {res} ({text})")


_contexts: dict[int, ctypes.c_void_p] = {}


def set_current_context(device_index: int) -> None:
    """Make the device's primary context (the one torch uses) current on this thread."""
    lib = driver()
    ctx = _contexts.get(device_index)
    if ctx is None:
        dev = ctypes.c_int()
        check(lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        _contexts[device_index] = ctx
    check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class HostMapped:
    """``n`` int32 words of pinned host memory that the kernel reads and writes directly."""

    def __init__(self, n: int) -> None:
        lib = driver()
        self.n = n
        self._host = ctypes.c_void_p()
        check(
            lib.cuMemHostAlloc(
                ctypes.byref(self._host),
                ctypes.c_size_t(4 * n),
                ctypes.c_uint(_CU_MEMHOSTALLOC_PORTABLE | _CU_MEMHOSTALLOC_DEVICEMAP),
            ),
            "cuMemHostAlloc",
        )
        dptr = ctypes.c_uint64()
        check(
            lib.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), self._host, ctypes.c_uint(0)),
            "cuMemHostGetDevicePointer",
        )
        self.device_ptr = dptr.value
        # Reads through this array go to memory every time (no Python-side caching).
        self.words = (ctypes.c_int32 * n).from_address(self._host.value)
        ctypes.memset(self._host.value, 0, 4 * n)

    def free(self) -> None:
        if self._host.value:
            driver().cuMemFreeHost(self._host)
            self._host = ctypes.c_void_p()


# The kernel's argument, built from kernels/layout.py (the source of csrc/layout.cuh's Params).
KernelParams = layout.KernelParams
KernelParamsTP = layout.KernelParamsTP  # a -DMK_TP=N build's: the base fields, then the TP tail
TP_MAX_RANKS = layout.TP_MAX_RANKS


class KernelModule:
    """One loaded cubin and its persistent decode function."""

    def __init__(self, cubin: Path, name: str, smem_bytes: int, threads: int) -> None:
        lib = driver()
        self._image = ctypes.create_string_buffer(cubin.read_bytes())
        self._module = ctypes.c_void_p()
        check(lib.cuModuleLoadData(ctypes.byref(self._module), self._image), "cuModuleLoadData")
        self._fn = ctypes.c_void_p()
        check(
            lib.cuModuleGetFunction(ctypes.byref(self._fn), self._module, name.encode()),
            "cuModuleGetFunction",
        )
        check(
            lib.cuFuncSetAttribute(
                self._fn, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes
            ),
            "cuFuncSetAttribute(max dynamic shared memory)",
        )
        per_sm = ctypes.c_int()
        check(
            lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(per_sm), self._fn, threads, ctypes.c_size_t(smem_bytes)
            ),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        )
        if per_sm.value < 1:
            raise BackendUnavailableError(
                f"the monokernel does not fit on one SM ({smem_bytes} B shared memory, "
                f"{threads} threads)"
            )
        self.smem_bytes = smem_bytes
        self.threads = threads

    def launch(
        self, grid: int, params: KernelParams, stream: int, cooperative: bool = True
    ) -> None:
        """Launch ``grid`` CTAs on ``stream`` (a CUstream handle): cooperative by default;
        a plain launch where a CUDA graph captures it (the prefill's all-reduce)."""
        arg = ctypes.c_void_p(ctypes.addressof(params))
        args = (ctypes.c_void_p * 1)(arg)
        dims = (ctypes.c_uint(grid), ctypes.c_uint(1), ctypes.c_uint(1))
        block = (ctypes.c_uint(self.threads), ctypes.c_uint(1), ctypes.c_uint(1))
        smem, handle = ctypes.c_uint(self.smem_bytes), ctypes.c_void_p(stream)
        lib = driver()
        if cooperative:
            res = lib.cuLaunchCooperativeKernel(self._fn, *dims, *block, smem, handle, args)
            check(res, "cuLaunchCooperativeKernel")
        else:
            res = lib.cuLaunchKernel(self._fn, *dims, *block, smem, handle, args, None)
            check(res, "cuLaunchKernel")

    def unload(self) -> None:
        if self._module.value:
            driver().cuModuleUnload(self._module)
            self._module = ctypes.c_void_p()


class DeviceKernel:
    """One entry point of a cubin loaded into ``device``'s primary context (torch's): the
    benchmarks' kernels, which take one ctypes Structure of parameters."""

    def __init__(self, cubin: Path, device: int, name: str, smem_bytes: int, threads: int) -> None:
        self.device = device
        set_current_context(device)
        self._module = KernelModule(cubin, name, smem_bytes, threads)

    def launch(
        self, grid: int, params: ctypes.Structure, stream: int, cooperative: bool = True
    ) -> None:
        """Cooperative by default: every CTA resident at once, or an error (never a partial
        grid)."""
        set_current_context(self.device)
        self._module.launch(grid, params, stream, cooperative)  # type: ignore[arg-type]

    def unload(self) -> None:
        set_current_context(self.device)
        self._module.unload()


def stream_done(stream: int) -> bool:
    """True once all work on the stream has finished; raises on a kernel fault."""
    res = driver().cuStreamQuery(ctypes.c_void_p(stream))
    if res == _CUDA_ERROR_NOT_READY:
        return False
    check(res, "the monokernel (cuStreamQuery)")
    return True
