"""Loading safetensors checkpoints: sharded, straight to a device and dtype, with a bar."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from monokernel.errors import (
    MissingTensorError,
    ModelNotFoundError,
    UnexpectedTensorError,
    WeightLoadError,
)
from monokernel.models.config import ModelConfig, load_hf_config
from monokernel.models.shapes import DENSE_SHAPES
from monokernel.weights import safetensors_loader
from monokernel.weights.names import Weights, hf_to_ours
from monokernel.weights.progress import summary_line
from monokernel.weights.random_checkpoint import write_random_checkpoint, write_safetensors
from monokernel.weights.safetensors_loader import (
    INDEX_FILE,
    _StagedReader,
    load_safetensors_weights,
    read_header,
    safetensors_files,
)

# The 'odd' shape (every optional tensor, no power-of-two sizes; 17.7 MB) in shards of at
# most 3 MB: seven files, each tensor whole in one of them.
SHARD_BYTES = 3_000_000


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Weights]:
    out = tmp_path_factory.mktemp("odd") / "ckpt"
    weights = write_random_checkpoint(
        out, DENSE_SHAPES["odd"], seed=5, vocab_from_tokenizer=True, shard_bytes=SHARD_BYTES
    )
    return out, weights


@pytest.fixture
def ckpt(written: tuple[Path, Weights], tmp_path: Path) -> Path:
    """A copy of the sharded checkpoint that a test may break."""
    return shutil.copytree(written[0], tmp_path / "ckpt")


def _cfg(path: Path) -> ModelConfig:
    return load_hf_config(path)


def _reference(path: Path) -> Weights:
    """Every tensor as the safetensors library reads it, in our names and its order."""
    out: Weights = {}
    for f in safetensors_files(path):
        tensors = load_file(f)
        with safe_open(str(f), framework="pt") as h:
            names = list(h.keys())
        for hf in names:
            t = tensors[hf]
            ours = hf_to_ours(hf)
            assert ours is not None
            out[ours] = t
    return out


def test_sharded_checkpoint_loads_the_written_tensors(written: tuple[Path, Weights]) -> None:
    path, weights = written
    assert len(safetensors_files(path)) == 7
    ref = _reference(path)
    mapped = load_safetensors_weights(path, _cfg(path))
    to_cpu = load_safetensors_weights(path, _cfg(path), device="cpu")
    # Both paths keep the order the loader always had: files in turn, safetensors' order.
    assert list(mapped) == list(to_cpu) == list(ref)
    assert set(mapped) == set(weights) == set(ref)
    for name, t in weights.items():
        for got in (mapped[name], to_cpu[name], ref[name]):
            assert got.dtype == torch.bfloat16 and got.device.type == "cpu"
            assert torch.equal(got, t), name


@pytest.mark.parametrize("device", [None, "cpu"])
def test_dtype_is_converted_as_read(written: tuple[Path, Weights], device: str | None) -> None:
    path, weights = written
    got = load_safetensors_weights(path, _cfg(path), device=device, dtype=torch.float32)
    assert {t.dtype for t in got.values()} == {torch.float32}
    for name, t in weights.items():
        assert torch.equal(got[name], t.float()), name


def test_chunks_that_split_elements(
    written: tuple[Path, Weights], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, weights = written
    # An odd chunk size cuts bf16 elements in two: the bytes must still land in place.
    monkeypatch.setattr(safetensors_loader, "STAGE_BYTES", 999)
    got = load_safetensors_weights(path, _cfg(path), device="cpu")
    assert all(torch.equal(got[n], t) for n, t in weights.items())


def test_staged_reads_on_the_cpu(written: tuple[Path, Weights]) -> None:
    """The GPU's path (alternating staging buffers) with synchronous CPU copies."""
    path, _ = written
    shard = safetensors_files(path)[1]
    ref = load_file(shard)
    reader = _StagedReader(torch.device("cpu"), chunk=1001, staged=True)
    seen: list[int] = []
    with open(shard, "rb", buffering=0) as fh:
        for entry in read_header(shard):
            t = reader.read(fh, shard, entry, seen.append)
            assert torch.equal(t, ref[entry.name]), entry.name
    assert sum(seen) == sum(t.numel() * t.element_size() for t in ref.values())
    assert max(seen) == 1001


def test_index_with_a_missing_shard(ckpt: Path) -> None:
    gone = safetensors_files(ckpt)[2]
    gone.unlink()
    with pytest.raises(ModelNotFoundError, match=gone.name):
        load_safetensors_weights(ckpt, _cfg(ckpt), device="cpu")


def test_truncated_shard_fails_before_reading(ckpt: Path) -> None:
    shard = safetensors_files(ckpt)[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(WeightLoadError, match="data offsets"):
        load_safetensors_weights(ckpt, _cfg(ckpt), device="cpu")


@pytest.mark.parametrize("content", [b"", b"\x05\x00\x00\x00\x00\x00\x00\x00nope!"])
def test_not_a_safetensors_file(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(content)
    with pytest.raises(WeightLoadError, match=r"bad\.safetensors"):
        read_header(bad)


def _rewrite_shard(path: Path, edit: object) -> None:
    # load_file maps the file: copy out before truncating it under the mapping.
    tensors = {k: v.clone() for k, v in load_file(path).items()}
    edit(tensors)  # type: ignore[operator]
    write_safetensors(path, list(tensors.items()), {"format": "pt"})


def test_missing_tensor_fails_before_any_data_is_read(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shard = safetensors_files(ckpt)[-1]
    _rewrite_shard(shard, lambda t: t.pop("lm_head.weight"))

    def refuse(*_: object) -> None:
        raise AssertionError("tensor data read although the headers show a tensor missing")

    monkeypatch.setattr(_StagedReader, "read", refuse)
    with pytest.raises(MissingTensorError, match="lm_head"):
        load_safetensors_weights(ckpt, _cfg(ckpt), device="cpu")


def test_tensor_in_two_shards(ckpt: Path) -> None:
    first, last = safetensors_files(ckpt)[0], safetensors_files(ckpt)[-1]
    copy = load_file(first)["model.embed_tokens.weight"].clone()
    _rewrite_shard(last, lambda t: t.__setitem__("model.embed_tokens.weight", copy))
    with pytest.raises(UnexpectedTensorError, match=r"embed_tokens.*in both"):
        load_safetensors_weights(ckpt, _cfg(ckpt))


def test_index_only_reads_the_shards_it_names(ckpt: Path) -> None:
    index = json.loads((ckpt / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) == 7
    # A stray file beside the shards is not part of the checkpoint.
    shutil.copy(safetensors_files(ckpt)[0], ckpt / "stray.safetensors")
    assert "stray.safetensors" not in {f.name for f in safetensors_files(ckpt)}
    load_safetensors_weights(ckpt, _cfg(ckpt), device="cpu")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("progress", "force", "tty", "shown"),
    [
        (True, False, False, False),  # a log file or a test: quiet
        (False, False, True, False),  # not asked for
        (True, False, True, True),  # someone is watching
        (False, True, False, True),  # forced
    ],
)
def test_progress_only_where_watched_or_forced(
    written: tuple[Path, Weights],
    monkeypatch: pytest.MonkeyPatch,
    progress: bool,
    force: bool,
    tty: bool,
    shown: bool,
) -> None:
    path, _ = written
    err = _Terminal() if tty else io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    load_safetensors_weights(
        path, _cfg(path), device="cpu", progress=progress, force_progress=force
    )
    out = err.getvalue()
    if not shown:
        assert out == ""
        return
    assert "loading ckpt" in out
    last = out.rstrip("\n").splitlines()[-1].split("\r")[-1].strip()
    assert last.startswith("loaded 17.7 MB in ") and last.endswith(" from 7 shards"), last


def test_summary_line() -> None:
    assert summary_line(16_100_000_000, 12.3, 4) == (
        "loaded 16.1 GB in 12.3 s (1.31 GB/s) from 4 shards"
    )
    assert summary_line(19_100_000, 0.25, 1) == "loaded 19.1 MB in 0.250 s (0.08 GB/s) from 1 shard"


@pytest.mark.gpu
def test_loads_straight_to_the_gpu(
    written: tuple[Path, Weights], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, weights = written
    # Small chunks: many asynchronous copies per tensor, each pinned buffer reused often.
    monkeypatch.setattr(safetensors_loader, "STAGE_BYTES", 4099)
    got = load_safetensors_weights(path, _cfg(path), device="cuda", dtype=torch.float32)
    for name, t in weights.items():
        assert got[name].device.type == "cuda" and got[name].dtype == torch.float32
        assert torch.equal(got[name].cpu(), t.float()), name
