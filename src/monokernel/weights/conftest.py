"""Fixtures the weights tests share."""

from __future__ import annotations

import pytest
import torch

from monokernel.weights.lazy_weights import DenseSource


@pytest.fixture()
def made(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shape of every matrix a DenseSource makes, in order: a lazily loaded checkpoint's
    layer matrices that some code made dense."""
    calls: list[tuple[int, ...]] = []
    real = DenseSource.dense

    def counted(self: DenseSource) -> torch.Tensor:
        calls.append(tuple(self.shape))
        return real(self)

    monkeypatch.setattr(DenseSource, "dense", counted)
    return calls
