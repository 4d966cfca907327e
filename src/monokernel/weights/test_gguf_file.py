"""Our GGUF parse against gguf's own reader, on files written here with gguf's writer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from monokernel.errors import WeightLoadError
from monokernel.weights.gguf_file import GGUFFile, StringArray, read_gguf

gguf = pytest.importorskip("gguf")
QT = gguf.GGMLQuantizationType


def write_everything(path: Path) -> Path:
    """Every metadata value type, and tensors in float and block formats."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo 🤖")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.strs", ["a", "", "ü", "<|im_end|>"])
    w.add_array("t.empty", [])
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 8)).astype(np.float16))
    w.add_tensor("vec", rng.standard_normal(7).astype(np.float32))
    for qtype in (QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1):
        a = rng.standard_normal((2, 256)).astype(np.float32)
        w.add_tensor(qtype.name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    for qtype in (QT.Q4_K, QT.Q6_K):  # gguf cannot quantise these; any bytes parse the same
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        raw = rng.integers(0, 256, (2, block_bytes), dtype=np.uint8)
        w.add_tensor(qtype.name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_metadata_and_tensors_equal_gguf_reader(tmp_path: Path) -> None:
    path = write_everything(tmp_path / "all.gguf")
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    got = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in ours.metadata.items()}
    assert got == expected
    assert got["t.str"] == "héllo 🤖" and got["t.strs"] == ["a", "", "ü", "<|im_end|>"]
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == int(ref.tensor_type), mine.name
        assert mine.dims == tuple(ref.shape.tolist()) and mine.offset == ref.data_offset
        data = ours.tensor_bytes(mine)
        assert data.dtype == ref.data.dtype and data.shape == ref.data.shape, mine.name
        assert np.array_equal(data, ref.data), mine.name
    assert ours.tensors[2].shape == (7,) and ours.tensors[0].shape == (3, 5)


def test_string_arrays_are_read_when_used(tmp_path: Path) -> None:
    """A string array is stepped over by the parse (a vocabulary is most of a header) and
    decoded on first use, whole."""
    strs = GGUFFile(write_everything(tmp_path / "all.gguf")).metadata["t.strs"]
    assert isinstance(strs, StringArray) and len(strs) == 4
    assert strs._items is None  # not decoded by the parse
    assert strs[2] == "ü" and strs[1:] == ["", "ü", "<|im_end|>"] and next(iter(strs)) == "a"
    assert strs == ["a", "", "ü", "<|im_end|>"] and strs != ["a"]


def test_header_digest_covers_metadata_only(tmp_path: Path) -> None:
    a = write_everything(tmp_path / "a.gguf")
    b = tmp_path / "b.gguf"
    raw = bytearray(a.read_bytes())
    raw[-1] ^= 0xFF  # a tensor byte: the header is unchanged
    b.write_bytes(bytes(raw))
    assert GGUFFile(a).header_digest() == GGUFFile(b).header_digest()
    c = tmp_path / "c.gguf"
    c.write_bytes(a.read_bytes().replace("héllo".encode(), b"hallo".ljust(6, b"!")))
    assert GGUFFile(c).header_digest() != GGUFFile(a).header_digest()


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", "not a readable GGUF"),
        (b"GGML" + bytes(20), "magic"),
        (b"GGUF" + (7).to_bytes(4, "little") + bytes(16), "version 7"),
        # Five key/values announced, none there.
        (b"GGUF" + (3).to_bytes(4, "little") + bytes(8) + (5).to_bytes(8, "little"), "readable"),
    ],
)
def test_broken_files_are_refused_by_name(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(WeightLoadError, match=match) as info:
        GGUFFile(path)
    assert str(path) in str(info.value)


def test_truncated_tensor_data_is_refused(tmp_path: Path) -> None:
    path = write_everything(tmp_path / "all.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-64])
    f = GGUFFile(cut)
    with pytest.raises(WeightLoadError, match="runs past the end"):
        f.tensor_bytes(f.tensors[-1])


def test_read_gguf_parses_an_unchanged_file_once(tmp_path: Path) -> None:
    path = write_everything(tmp_path / "all.gguf")
    assert read_gguf(path) is read_gguf(path)
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "missing.gguf")
