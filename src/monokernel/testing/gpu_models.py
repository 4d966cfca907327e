"""What the GPU tests of the monokernel share: whether a Hopper GPU is here (and can hold a
shape), token ids from a seed, a backend on random weights in a row format, and the real
default model loaded onto the GPU (skipping where it cannot be)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from monokernel import envs
from monokernel.models.config import ModelConfig
from monokernel.weights.names import Weights

if TYPE_CHECKING:
    from monokernel.runtime.backends.monokernel import MonokernelBackend

# The row formats a verify pass builds for (docs/speculative.md), as --quantize spells them.
ROW_FORMATS = ("bf16", "fp8", "int8", "int4", "int4:GROUP")


def hopper() -> bool:
    """A Hopper GPU (sm_90), which the monokernel is built for."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# The skip mark of a test that needs a Hopper GPU (pair it with pytest.mark.gpu).
needs_hopper = pytest.mark.skipif(not hopper(), reason="needs a Hopper GPU (sm_90)")


def hopper_gpus(n: int) -> bool:
    """``n`` Hopper GPUs that reach each other's memory (the TP kernel's peer stores)."""
    return (
        torch.cuda.is_available()
        and torch.cuda.device_count() >= n
        and all(torch.cuda.get_device_capability(d) == (9, 0) for d in range(n))
        and all(
            torch.cuda.can_device_access_peer(a, b) for a in range(n) for b in range(n) if a != b
        )
    )


def hopper_pair() -> bool:
    """Two Hopper GPUs that reach each other's memory."""
    return hopper_gpus(2)


# The skip mark of a test that needs two of them (pair it with pytest.mark.gpu).
needs_hopper_pair = pytest.mark.skipif(
    not hopper_pair(), reason="needs 2 Hopper GPUs (sm_90) with peer access"
)
# ... and of one that needs four.
needs_hopper_quad = pytest.mark.skipif(
    not hopper_gpus(4), reason="needs 4 Hopper GPUs (sm_90) with peer access between all"
)


def hopper_with(gib: float) -> bool:
    """A Hopper GPU (sm_90) with at least ``gib`` GiB of memory."""
    return hopper() and torch.cuda.mem_get_info()[1] >= gib * 2**30


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rows_backend(
    cfg: ModelConfig, weights: Weights, max_len: int, device: torch.device, fmt: str
) -> MonokernelBackend:
    """The monokernel backend on ``weights`` with its layers packed in ``fmt`` (one of
    ROW_FORMATS; int4 in groups of 128 unless ``int4:GROUP`` says, quantised to nearest with
    an fp32 prefill) and streamed as rows, as the default model's Q4_1 layers are."""
    from monokernel.runtime.backends.monokernel import MonokernelBackend
    from monokernel.weights.group_quant import quantize_rtn
    from monokernel.weights.quantize import is_quantized

    name, group = row_format(fmt)
    if name == "bf16":
        return MonokernelBackend(cfg, weights, max_len, device)
    with envs.overridden(MONOKERNEL_WEIGHT_LAYOUT="rows"):
        if name != "int4":
            return MonokernelBackend(cfg, weights, max_len, device, quantize=name)
        groups = {k: quantize_rtn(v, group) for k, v in weights.items() if is_quantized(k)}
        return MonokernelBackend(
            cfg, weights, max_len, device, quantize="int4", groups=groups,
            prefill_precision="fp32",
        )  # fmt: skip


def row_format(fmt: str) -> tuple[str, int]:
    """(format, int4 group or 0) of one of ROW_FORMATS; ValueError naming them otherwise."""
    from monokernel.weights.formats.int4 import DEFAULT_GROUP

    name, _, group = fmt.partition(":")
    if name in ("bf16", "fp8", "int8") and not group:
        return name, 0
    if name == "int4" and (not group or group.isdigit()):
        return name, int(group or DEFAULT_GROUP)
    raise ValueError(f"{fmt!r} is not a row format: one of {', '.join(ROW_FORMATS)}")


def default_model_file() -> Path:
    """The real default model's GGUF (SmolLM2-135M-Instruct Q4_1); skips the test where the
    GGUF reader is missing or the model is neither cached nor fetchable."""
    pytest.importorskip("gguf")  # the GGUF reader: a package the GPU image may lack
    from monokernel.errors import ModelNotFoundError
    from monokernel.weights.default_model import default_model_path

    try:
        return default_model_path(progress=False)
    except ModelNotFoundError as e:
        pytest.skip(f"the default model is not cached and cannot be fetched here: {e}")


def default_model_on_gpu(user_message: str) -> tuple[ModelConfig, Weights, list[int]]:
    """The real default model (SmolLM2-135M-Instruct, its Q4_1 GGUF dequantised) as bf16 on
    the GPU, and ``user_message`` through its chat template; skips the test where the GGUF
    reader is missing or the model is neither cached nor fetchable."""
    from monokernel.tokenizer.tokenizer import Tokenizer
    from monokernel.weights.lazy_weights import cast_mapping
    from monokernel.weights.loader import load_checkpoint

    ckpt = load_checkpoint(str(default_model_file()))
    tok = Tokenizer.load(ckpt.tokenizer_dir, ckpt.gguf_file)
    prompt = tok.encode_chat([{"role": "user", "content": user_message}])
    dev = torch.device("cuda")
    # The tests compare with the reference on these dense values (or quantise them), so
    # every matrix is made; each straight into bf16 on the GPU, none held in float32.
    weights = dict(cast_mapping(ckpt.weights, torch.bfloat16, dev, consume=True))
    return ckpt.config, weights, prompt
