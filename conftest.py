"""Suite-wide pytest setup: `gpu` tests skip cleanly on machines without a CUDA device."""

from __future__ import annotations

import pytest


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
