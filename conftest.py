"""Suite-wide pytest setup: `gpu` tests skip cleanly on machines without a CUDA device, and
each starts with the GPU memory earlier tests left to the garbage collector freed."""

from __future__ import annotations

import os

import pytest

# The monokernel backend times a few places for its hand-off buffer at load (~2 s on a real
# shape; runtime/backends/monokernel/handoff_placement.py). Where the buffer lies changes no
# result, so the suite's many backends skip it; the search's own tests ask for it.
os.environ.setdefault("MONOKERNEL_HANDOFF_SEARCH", "0")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (pytest marker `gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item: pytest.Item) -> None:
    # A backend that dies with its test sits in reference cycles until the collector runs:
    # tens of GB on the 8B-32B shapes, which the next large test then cannot allocate.
    if "gpu" in item.keywords and _cuda_available():
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
