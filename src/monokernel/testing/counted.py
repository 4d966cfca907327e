"""Counting calls in tests: to a callable a test wraps, and to the making of dense matrices."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from monokernel.weights.lazy_weights import DenseSource


class Counted:
    """A callable that counts its calls and passes them on to ``fn``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return self.fn(*args)


def count_dense(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shape of every matrix a DenseSource makes from here on, in order: a lazily
    loaded checkpoint's layer matrices that some code made dense."""
    calls: list[tuple[int, ...]] = []
    real = DenseSource.dense

    def counted(self: DenseSource) -> torch.Tensor:
        calls.append(tuple(self.shape))
        return real(self)

    monkeypatch.setattr(DenseSource, "dense", counted)
    return calls
