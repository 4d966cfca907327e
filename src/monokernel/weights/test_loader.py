"""Loading local HF directories: what loads, and each named failure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from monokernel.errors import (
    MissingTensorError,
    ModelNotFoundError,
    TensorShapeError,
    UnexpectedTensorError,
    UnsupportedModelError,
)
from monokernel.testing.tiny_models import make_tiny_checkpoint
from monokernel.weights.loader import load_checkpoint
from monokernel.weights.names import expected_shapes


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return make_tiny_checkpoint("qwen2", tmp_path / "qwen2")


def _edit_tensors(path: Path, edit: object) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)  # type: ignore[operator]
    save_file(tensors, path / "model.safetensors")


def test_loads_all_tensors_in_our_names(tiny: Path) -> None:
    ckpt = load_checkpoint(tiny)
    assert set(ckpt.weights) == set(expected_shapes(ckpt.config))
    assert ckpt.eos_token_ids == (2,)
    assert ckpt.gguf_file is None


def test_sharded_checkpoint(tmp_path: Path) -> None:
    src = make_tiny_checkpoint("llama3", tmp_path / "one")
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    out = tmp_path / "sharded"
    out.mkdir()
    (out / "config.json").write_text((src / "config.json").read_text())
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, out / fname)
        weight_map |= {n: fname for n in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ckpt = load_checkpoint(out)
    assert torch.equal(ckpt.weights["embed"], tensors["model.embed_tokens.weight"])


def test_loads_to_the_device_and_dtype_asked(tiny: Path) -> None:
    as_stored = load_checkpoint(tiny, progress=False)
    cast = load_checkpoint(tiny, progress=False, device="cpu", dtype=torch.bfloat16)
    assert {t.dtype for t in cast.weights.values()} == {torch.bfloat16}
    assert set(cast.weights) == set(as_stored.weights)
    for name, t in as_stored.weights.items():
        assert t.dtype == torch.float32  # what save_pretrained wrote
        assert torch.equal(cast.weights[name], t.to(torch.bfloat16)), name


def test_missing_tensor_is_named(tiny: Path) -> None:
    _edit_tensors(tiny, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(MissingTensorError, match=r"layers\.1\.w_up"):
        load_checkpoint(tiny)


def test_wrong_shape_is_named(tiny: Path) -> None:
    def shrink(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(5, 72)

    _edit_tensors(tiny, shrink)
    with pytest.raises(TensorShapeError, match=r"layers\.0\.wk has shape \(5, 72\)"):
        load_checkpoint(tiny)


def test_unused_tensor_is_named(tiny: Path) -> None:
    _edit_tensors(tiny, lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(3)))
    with pytest.raises(UnexpectedTensorError, match=r"model\.layers\.0\.extra\.weight"):
        load_checkpoint(tiny)


def test_untied_lm_head_in_tied_model_is_refused(tiny: Path) -> None:
    _edit_tensors(tiny, lambda t: t.__setitem__("lm_head.weight", torch.randn(131, 72)))
    with pytest.raises(UnexpectedTensorError, match="lm_head differs"):
        load_checkpoint(tiny)


def test_unsupported_architecture(tiny: Path) -> None:
    cfg = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps(cfg | {"model_type": "phi3"}))
    with pytest.raises(UnsupportedModelError, match="model_type 'phi3'"):
        load_checkpoint(tiny)


def test_path_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_directory_without_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        load_checkpoint(tmp_path)


def test_hub_id_offline_error_shows_local_form(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub

    def offline(*_: object, **__: object) -> str:
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelNotFoundError, match="--model /path/to/model_dir"):
        load_checkpoint("someorg/some-model-that-is-not-local")
