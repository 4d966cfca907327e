"""Writing a test checkpoint's tensors as HF does: one ``model.safetensors``, or two shards
and their index. What the quantised-checkpoint tests (FP8, AWQ, GPTQ) share."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from monokernel.weights.safetensors_loader import INDEX_FILE, SINGLE_FILE

Edit = Callable[[dict[str, torch.Tensor]], None]


def save_checkpoint_tensors(
    dst: Path,
    first: dict[str, torch.Tensor],
    second: dict[str, torch.Tensor],
    split: bool,
    edit: Edit | None = None,
) -> None:
    """``first`` and ``second`` into ``dst``: two shards and an index when ``split``, else one
    file of both. ``edit`` changes the tensors of both first (a test's malformed checkpoint),
    each staying in its shard."""
    if edit is not None:
        both = first | second
        edit(both)
        first = {k: v for k, v in both.items() if k not in second}
        second = {k: v for k, v in both.items() if k in second}
    if split:
        files = {
            "model-00001-of-00002.safetensors": first,
            "model-00002-of-00002.safetensors": second,
        }
        for fname, part in files.items():
            save_file(part, str(dst / fname), metadata={"format": "pt"})
        weight_map = {k: f for f, part in files.items() for k in part}
        (dst / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        save_file(first | second, str(dst / SINGLE_FILE), metadata={"format": "pt"})
