"""The bench's copies of a GGUF's weights (``bench/cli.py`` ``_load``, ``bench/spec.py``
``checkpoint_backends``): the engines there compute with the dense matrices, so they are
made, but each straight into the bench's dtype and device and none kept in float32 by the
checkpoint (a 32B Q4_K_M's layer matrices are ~130 GB of float32)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch

from monokernel.weights.lazy_weights import DenseSource, LazyWeights
from monokernel.weights.loader import Checkpoint, load_checkpoint

gguf = pytest.importorskip("gguf")


@pytest.fixture()
def q4_k_m(tmp_path: Path) -> Path:
    from monokernel.weights.test_gguf_loader import QT, k_quant_gguf

    edge = {"token_embd.weight": QT.Q4_K, "output.weight": QT.Q6_K}
    return k_quant_gguf(tmp_path / "m.gguf", (QT.Q4_K, QT.Q6_K), edge=edge)


@pytest.fixture()
def made(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The dtype each matrix a DenseSource makes is made in, in order."""
    calls: list[torch.dtype] = []
    real = DenseSource.dense

    def counted(self: DenseSource) -> torch.Tensor:
        calls.append(self.dtype)
        return real(self)

    monkeypatch.setattr(DenseSource, "dense", counted)
    return calls


def _old_copy(ckpt: Checkpoint, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What both made before: every tensor read in float32, then cast (on a copy here)."""
    lazy = ckpt.weights.copy()  # type: ignore[attr-defined]
    return {k: v.to(dtype=dtype) for k, v in lazy.items()}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert type(got) is dict and list(got) == list(want)
    for k, v in got.items():
        assert v.dtype == want[k].dtype and torch.equal(v, want[k]), k


def test_load_makes_each_matrix_once_in_the_bench_dtype(
    q4_k_m: Path, made: list[torch.dtype]
) -> None:
    from monokernel.bench.cli import _load

    ckpt = load_checkpoint(str(q4_k_m), progress=False)
    assert ckpt.groups is not None
    want = _old_copy(ckpt, torch.bfloat16)
    made.clear()
    cfg, weights, _, _ = _load(
        argparse.Namespace(model=str(q4_k_m)), torch.device("cpu"), torch.bfloat16, True
    )
    assert cfg == ckpt.config and isinstance(weights, dict)
    # The embedding and the head in float32 at load, as every engine reads them; then each
    # layer matrix once, in bf16: no float32 copy of one kept by anyone.
    assert made == [torch.float32] * 2 + [torch.bfloat16] * len(ckpt.groups)
    _same(weights, want)


def test_spec_backends_leave_the_checkpoint_unread(
    q4_k_m: Path, made: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    from monokernel.bench.spec import checkpoint_backends
    from monokernel.runtime import backends

    given: list[dict[str, torch.Tensor]] = []

    def construct(engine: str, cfg: Any, weights: dict[str, torch.Tensor], *args: Any) -> str:
        given.append(weights)
        return engine

    monkeypatch.setattr(backends, "construct_backend", construct)
    ckpt = load_checkpoint(str(q4_k_m), progress=False)
    assert isinstance(ckpt.weights, LazyWeights) and ckpt.groups is not None
    want = _old_copy(ckpt, torch.float16)
    made.clear()
    open_backend = checkpoint_backends(ckpt, torch.device("cpu"), torch.float16)
    for engine in ("reference", "torch"):  # each backend its own copy, as before
        assert open_backend(engine, 32) == engine
    assert made == [torch.float16] * (2 * len(ckpt.groups))
    assert sorted(ckpt.weights.unread()) == sorted(ckpt.groups)  # none kept in float32
    for weights in given:
        _same(weights, want)
    assert given[0]["layers.0.wq"] is not given[1]["layers.0.wq"]
