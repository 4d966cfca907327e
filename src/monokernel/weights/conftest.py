"""Fixtures the weights tests share."""

from __future__ import annotations

import pytest

from monokernel.testing.counted import count_dense


@pytest.fixture()
def made(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shape of every matrix a DenseSource makes, in order (count_dense)."""
    return count_dense(monkeypatch)
