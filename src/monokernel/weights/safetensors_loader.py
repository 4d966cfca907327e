"""Load an HF checkpoint directory (one or sharded ``*.safetensors``) into our names."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from monokernel.errors import ModelNotFoundError, UnexpectedTensorError
from monokernel.models.config import ModelConfig
from monokernel.weights.names import HF_IGNORED, Weights, check_weights, hf_to_ours

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The shard files of a checkpoint, from its index when sharded."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelNotFoundError(f"{index} names shard(s) that are missing: {absent}")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return found
    raise ModelNotFoundError(
        f"{model_dir} holds no {SINGLE_FILE}, {INDEX_FILE} or other *.safetensors file"
    )


def load_safetensors_weights(model_dir: Path, cfg: ModelConfig) -> Weights:
    from safetensors import safe_open

    weights: Weights = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for hf_name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if HF_IGNORED.match(hf_name):
                    continue
                ours = hf_to_ours(hf_name)
                if ours is None:
                    raise UnexpectedTensorError(
                        f"{path.name}: tensor {hf_name} is not used by a {cfg.family} model"
                    )
                weights[ours] = f.get_tensor(hf_name)
    return check_weights(weights, cfg, source=str(model_dir))


def cast_weights(weights: Weights, dtype: torch.dtype, device: torch.device | str) -> Weights:
    """Every tensor in ``dtype`` on ``device``; the input dict is emptied as it goes so a
    large CPU copy is not held twice."""
    out: Weights = {}
    for name in list(weights):
        out[name] = weights.pop(name).to(device=device, dtype=dtype)
    return out
