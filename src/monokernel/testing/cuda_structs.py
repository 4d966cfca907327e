"""Whether a ctypes mirror matches the CUDA struct it mirrors: nvcc compiles static_asserts of
the struct's size and every field's offset (CPU tests; nvcc, no GPU)."""

from __future__ import annotations

import ctypes
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from monokernel.kernels.build import ARCH_FLAGS, find_nvcc


def struct_mismatch(
    mirror: type[ctypes.Structure],
    struct: str,
    source: Path,
    tmp: Path,
    c_names: Mapping[str, str] | None = None,
    extra: Sequence[str] = (),
) -> str | None:
    """nvcc's complaint where ``mirror`` differs from ``struct`` in ``source`` (None where
    they agree). ``c_names``: ctypes field -> C field where they differ (a Python keyword);
    ``extra``: more static_asserts."""
    checks = [f'static_assert(sizeof({struct}) == {ctypes.sizeof(mirror)}, "sizeof");']
    for name, *_ in mirror._fields_:
        c = (c_names or {}).get(name, name)
        off = getattr(mirror, name).offset
        checks.append(f'static_assert(offsetof({struct}, {c}) == {off}, "{c}");')
    src = tmp / "mirror.cu"
    src.write_text(f'#include <cstddef>\n#include "{source}"\n' + "\n".join([*checks, *extra]))
    cmd = [find_nvcc(), *ARCH_FLAGS, "-c", "-o", str(tmp / "mirror.o"), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    return None if proc.returncode == 0 else proc.stderr
