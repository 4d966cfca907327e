"""The load-time tool: what it reports, on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from monokernel.models.shapes import DENSE_SHAPES
from monokernel.weights.load_time import main, plain_read, resident_fraction
from monokernel.weights.random_checkpoint import write_random_checkpoint
from monokernel.weights.safetensors_loader import safetensors_files


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("odd") / "ckpt"
    write_random_checkpoint(
        out, DENSE_SHAPES["odd"], vocab_from_tokenizer=True, shard_bytes=5_000_000
    )
    return out


def test_reports_each_read_memory_and_the_ceiling(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(ckpt), "--device", "cpu", "--repeat", "2", "--cold"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"checkpoint: {ckpt} (qwen3, 3 layers, 4 files, 17.7 MB) -> ")
    assert lines[0].endswith("cpu float32")
    assert lines[1].startswith("read 1: 17.7 MB in ") and "after eviction, page cache" in lines[1]
    assert lines[2].startswith("read 2: 17.7 MB in ") and "GB/s; page cache held" in lines[2]
    assert lines[3].startswith("host memory: RSS ")
    assert lines[4].startswith("plain read of the files") and len(lines) == 5


def test_checkpoint_dtype_and_no_plain_read(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [str(ckpt), "--device", "cpu", "--dtype", "checkpoint", "--repeat", "1"]
    assert main([*args, "--no-plain-read", "--progress"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0].endswith("cpu checkpoint dtype")
    assert len(captured.out.splitlines()) == 3
    assert "from 4 shards" in captured.err  # --progress forces the bar and its summary


def test_plain_read_and_residency(ckpt: Path) -> None:
    files = safetensors_files(ckpt)
    nbytes, seconds = plain_read(files)
    assert nbytes == sum(f.stat().st_size for f in files) and seconds > 0
    frac = resident_fraction(files)
    # Just read, so cached, unless this system cannot say.
    assert frac is None or frac > 0.9
