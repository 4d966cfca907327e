"""A GGUF in the bench (``bench/cli.py`` ``_load``, ``bench/engines.py`` ``CheckpointWeights``
and ``open_runner``; ``bench/spec.py`` ``checkpoint_backends``): each engine gets what
``monokernel run`` gives it. The monokernel is handed the file's own groups and never makes a
layer matrix dense, and its bytes per token are the packed ones; the engines that compute
with the dense matrices get them, each made once, straight in the bench's dtype, none kept
in float32 by the checkpoint (a 32B Q4_K_M's layer matrices are ~130 GB of float32)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from monokernel.bench.records import validate
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.weights.lazy_weights import DenseSource, LazyWeights
from monokernel.weights.loader import Checkpoint, load_checkpoint
from monokernel.weights.quantize import is_quantized

gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")


@pytest.fixture()
def q4_k_m(tmp_path: Path) -> Path:
    from monokernel.weights.test_gguf_loader import QT, k_quant_gguf

    edge = {"token_embd.weight": QT.Q4_K, "output.weight": QT.Q6_K}
    return k_quant_gguf(tmp_path / "m.gguf", (QT.Q4_K, QT.Q6_K), edge=edge)


@pytest.fixture()
def q4_0(tmp_path: Path) -> Path:
    from monokernel.weights.test_gguf_loader import (
        QT,
        SIZES_4BIT,
        _all_4bit,
        tiny_hf,
        write_gguf,
    )

    _, state = tiny_hf("llama", tied=False, sizes=SIZES_4BIT)
    types = _all_4bit(QT.Q4_0, state)
    return write_gguf(tmp_path / "q4_0.gguf", "llama", state, types=types, sizes=SIZES_4BIT)


@pytest.fixture(params=["q4_k_m", "q4_0"])
def gguf_file(request: pytest.FixtureRequest) -> Path:
    path: Path = request.getfixturevalue(request.param)
    return path


@pytest.fixture()
def made(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The shape and dtype of each matrix a DenseSource makes, in order."""
    calls: list[tuple[tuple[int, ...], torch.dtype]] = []
    real = DenseSource.dense

    def counted(self: DenseSource) -> torch.Tensor:
        calls.append((tuple(self.shape), self.dtype))
        return real(self)

    monkeypatch.setattr(DenseSource, "dense", counted)
    return calls


def _old_copy(ckpt: Checkpoint, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor read in float32, then cast (on a copy here)."""
    lazy = ckpt.weights.copy()  # type: ignore[attr-defined]
    return {k: v.to(dtype=dtype) for k, v in lazy.items()}


def _same(got: Mapping[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k, v in got.items():
        assert v.dtype == want[k].dtype and torch.equal(v, want[k]), k


def test_load_leaves_the_layer_matrices_unread(
    q4_k_m: Path, made: list[tuple[tuple[int, ...], torch.dtype]]
) -> None:
    from monokernel.bench.cli import _load
    from monokernel.bench.engines import CheckpointWeights

    cfg, source, label, _ = _load(argparse.Namespace(model=str(q4_k_m)), CPU, torch.bfloat16, True)
    assert isinstance(source, CheckpointWeights)
    ckpt = source.ckpt
    assert cfg == ckpt.config and ckpt.groups is not None
    # Only the embedding and the LM head, at load, as every engine reads them.
    assert made == [((cfg.vocab_size, cfg.hidden_size), torch.float32)] * 2
    assert sorted(ckpt.weights.unread()) == sorted(ckpt.groups)  # type: ignore[attr-defined]
    # The table's header says what the monokernel streams (at these small sizes the 4-bit
    # groups widen to int8 beside the 8-bit ones: quantize.groups_plan).
    assert label == f"{q4_k_m} (int8 checkpoint; the monokernel streams groups int8-g16)"


def test_dense_engines_make_each_matrix_once_in_the_bench_dtype(
    q4_k_m: Path, made: list[tuple[tuple[int, ...], torch.dtype]]
) -> None:
    from monokernel.bench.engines import CheckpointWeights

    ckpt = load_checkpoint(str(q4_k_m), progress=False)
    assert ckpt.groups is not None
    want = _old_copy(ckpt, torch.bfloat16)
    made.clear()
    source = CheckpointWeights(ckpt, torch.bfloat16)
    first, _ = source.weights(CPU, dense=True)
    second, owned = source.weights(CPU, dense=True)
    # Each layer matrix once, in bf16: no float32 copy of one kept by anyone.
    assert [dtype for _, dtype in made] == [torch.bfloat16] * len(ckpt.groups)
    _same(first, want)
    _same(second, want)
    assert first is not second and type(first) is dict  # each backend a mapping of its own
    assert not owned  # already where and as the engine wants them: shared, not consumed
    assert sorted(ckpt.weights.unread()) == sorted(ckpt.groups)  # type: ignore[attr-defined]
    # The monokernel's mapping leaves them unread, and its tensors are its own.
    lazy, owned = source.weights(CPU, dense=False)
    assert isinstance(lazy, LazyWeights) and sorted(lazy.unread()) == sorted(ckpt.groups)
    assert owned and len(made) == len(ckpt.groups)


class _StandIn:
    """A backend that records what it was built with and emits made-up tokens."""

    built: ClassVar[list[dict[str, Any]]] = []

    def __init__(
        self, cfg: Any, weights: Mapping[str, torch.Tensor], max_len: int, device: Any, **kw: Any
    ) -> None:
        unread = weights.unread() if isinstance(weights, LazyWeights) else []
        layers = {k: weights[k] for k in weights if is_quantized(k) and k not in unread}
        self.built.append({"kwargs": kw, "unread": unread, "layers": layers})

    def stream(self, request: DecodeRequest, cancel: CancelToken) -> Iterator[int]:
        yield from range(request.max_new_tokens)

    def close(self) -> None:
        pass


def _bench(
    path: Path, engines: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    """``monokernel bench --model PATH --engines ENGINES`` on the CPU in bf16, every backend
    a stand-in (the monokernel's included: its GPU check is lifted); the JSON document."""
    from monokernel.bench import cli
    from monokernel.runtime.backends import BACKEND_CLASSES

    monkeypatch.setattr(cli, "GPU_ONLY", frozenset())
    monkeypatch.setattr(_StandIn, "built", [])
    for engine in ("monokernel", "torch"):
        monkeypatch.setitem(BACKEND_CLASSES, engine, (__name__, "_StandIn"))
    out = tmp_path / "bench.json"
    argv = ["--model", str(path), "--device", "cpu", "--dtype", "bfloat16"]
    argv += ["--engines", engines, "--prompt-tokens", "8", "--gen-tokens", "4", "--repeats", "1"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    return validate(json.loads(out.read_text()))


def test_bench_hands_the_monokernel_the_groups_and_the_others_dense_matrices(
    gguf_file: Path,
    made: list[tuple[tuple[int, ...], torch.dtype]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from monokernel.bench.measure import bytes_per_token, layer_matrix_shapes
    from monokernel.runtime.kv_memory import group_pack_bytes
    from monokernel.weights.quantize import groups_plan

    ckpt = load_checkpoint(str(gguf_file), progress=False)
    assert ckpt.groups is not None and ckpt.quantization is not None
    cfg = ckpt.config
    want = _old_copy(ckpt, torch.bfloat16)
    made.clear()
    doc = _bench(gguf_file, "monokernel,torch", tmp_path, monkeypatch)
    kernel, torch_engine = _StandIn.built
    # The monokernel: the checkpoint's groups, as run hands them over (runtime/engine.py),
    # its weights' layer matrices unread (and never read: nothing made them).
    kw = kernel["kwargs"]
    assert kw["quantize"] == ckpt.quantization and kw.get("consume_weights") is True
    assert sorted(kw["groups"]) == sorted(ckpt.groups)
    for name, gq in kw["groups"].items():
        assert (gq.bits, gq.group) == (ckpt.groups[name].bits, ckpt.groups[name].group)
        assert torch.equal(gq.q, ckpt.groups[name].q), name
    assert sorted(kernel["unread"]) == sorted(ckpt.groups) and kernel["layers"] == {}
    # The torch engine: every matrix dense in bf16, each made once for the run (from the
    # groups of the bench's own load); on the CPU, as run's, it decodes from 4-bit groups.
    _same(torch_engine["layers"], {k: v for k, v in want.items() if is_quantized(k)})
    assert [dtype for _, dtype in made] == [torch.float32] * 2 + [torch.bfloat16] * len(ckpt.groups)
    assert torch_engine["kwargs"]["cpu_packed"] is True
    assert ("groups" in torch_engine["kwargs"]) == (ckpt.quantization == "int4")
    # Bytes per token: the monokernel's layers as it packs the groups (kv_memory's count of
    # them), the torch engine's dense in bf16.
    cells = {c["engine"]: c for c in doc["cells"]}
    context = cells["monokernel"]["mean_context"]
    dense = bytes_per_token(cfg, context, 2)
    plan, _ = groups_plan(cfg, ckpt.groups)
    matrices = cfg.num_layers * sum(r * c for r, c in layer_matrix_shapes(cfg))
    packed = dense - 2 * matrices + group_pack_bytes(cfg, plan)
    assert cells["monokernel"]["bytes_per_token"] == pytest.approx(packed, rel=1e-12)
    assert packed < 0.8 * dense
    assert cells["torch"]["bytes_per_token"] == dense
    assert cells["monokernel"]["layer_format"].startswith("groups ")
    assert "layer_format" not in cells["torch"]
    assert cells["monokernel"]["layer_format"] in doc["model"]["label"]


def test_a_bench_format_label_repacks_the_dense_matrices(
    q4_k_m: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``monokernel:int8-g32`` on a GGUF: the bench's own 8-bit groups of its dense values,
    not the file's (groups of 16); counted as those."""
    doc = _bench(q4_k_m, "monokernel:int8-g32", tmp_path, monkeypatch)
    (kernel,) = _StandIn.built
    assert kernel["kwargs"]["quantize"] == "int8"
    assert {(g.bits, g.group) for g in kernel["kwargs"]["groups"].values()} == {(8, 32)}
    (cell,) = doc["cells"]
    assert cell["layer_format"] == "groups int8-g32"


def test_bench_hands_over_what_run_does(q4_0: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The quantisation, groups and FP8 blocks runtime/engine.py's Engine hands
    create_backend for a checkpoint, with and without --quantize, are loader.run_formats',
    which the bench hands its backends."""
    from monokernel import Engine, EngineConfig
    from monokernel.runtime import engine as engine_mod
    from monokernel.weights.loader import run_formats

    ckpt = load_checkpoint(str(q4_0), progress=False)
    assert ckpt.quantization == "int4"
    given: list[dict[str, Any]] = []

    def create_backend(*args: Any, **kw: Any) -> Any:
        given.append(kw)
        return object()

    monkeypatch.setattr(engine_mod, "create_backend", create_backend)
    monkeypatch.setattr(engine_mod.Tokenizer, "load", lambda *a, **k: None)
    for quantize in (None, "int4", "int8", "fp8"):
        config = EngineConfig(engine="reference", device="cpu", quantize=quantize, progress=False)
        Engine(ckpt, config)
        run = run_formats(ckpt, quantize)
        kw = given.pop()
        assert (kw["quantize"], kw["groups"], kw["fp8_blocks"]) == (
            run.quantize,
            run.groups,
            run.fp8_blocks,
        ), quantize


def test_spec_backends_leave_the_checkpoint_unread(
    q4_k_m: Path, made: list[tuple[tuple[int, ...], torch.dtype]], monkeypatch: pytest.MonkeyPatch
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
    open_backend = checkpoint_backends(ckpt, CPU, torch.float16)
    for engine in ("reference", "torch"):  # each backend its own copy, as before
        assert open_backend(engine, 32) == engine
    assert [dtype for _, dtype in made] == [torch.float16] * (2 * len(ckpt.groups))
    assert sorted(ckpt.weights.unread()) == sorted(ckpt.groups)  # none kept in float32
    for weights in given:
        _same(weights, want)
    assert given[0]["layers.0.wq"] is not given[1]["layers.0.wq"]
