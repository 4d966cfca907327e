"""Fixtures of the bench tests: one tiny random checkpoint, loaded once."""

from __future__ import annotations

from pathlib import Path

import pytest

from monokernel.testing.tiny_models import make_tiny_checkpoint
from monokernel.weights.loader import Checkpoint, load_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("bench") / "tiny")


@pytest.fixture(scope="session")
def tiny(tiny_dir: Path) -> Checkpoint:
    return load_checkpoint(str(tiny_dir), progress=False)
