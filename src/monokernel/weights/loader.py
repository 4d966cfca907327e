"""One entry point from a model reference to config + weights + tokenizer location.

A reference is one of:
- ``None``: the default model (SmolLM2-135M-Instruct, fetched once into the cache);
- a ``*.gguf`` file;
- a local HF directory (``config.json`` + safetensors, tokenizer files beside them);
- an HF hub id such as ``HuggingFaceTB/SmolLM2-135M-Instruct`` (needs network and
  ``huggingface_hub``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch

from monokernel.errors import ModelNotFoundError
from monokernel.models.config import ModelConfig, load_hf_config
from monokernel.weights.checkpoint_quant import Fp8Blocks
from monokernel.weights.group_quant import GroupQuant

# Checkpoint.quantization of a checkpoint whose layer matrices are all 4-bit.
CHECKPOINT_INT4 = "int4"


@dataclass(frozen=True, slots=True)
class Announced:
    """What a checkpoint's config says of its quantisation before any weight is read:
    ``quantization`` as Checkpoint.quantization will be if every layer matrix holds it
    (CHECKPOINT_INT4: AWQ or GPTQ; CHECKPOINT_FP8), None for float weights or a GGUF (whose
    blocks are known once read); ``group``: an int4 checkpoint's columns a group (-1: one
    group a row)."""

    quantization: str | None = None
    group: int = 0


# load_checkpoint's hook: called with the config and what it announces before any weight is
# read.
BeforeWeights = Callable[[ModelConfig, Announced], None] | None

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    config: ModelConfig
    # Our names. Safetensors: on the device and in the dtype load_checkpoint was given, else
    # the checkpoint's dtype on the CPU (an FP8 or 4-bit module's weight: bfloat16); a dict,
    # but where some layer linear weight is stored in 4 bits (AWQ, GPTQ): a LazyWeights
    # (weights/lazy_weights.py) whose 4-bit layer matrices are made from their GroupQuant
    # (``groups`` when every one is 4-bit) on that device in that dtype when first read.
    # GGUF: float32 (dequantised) on the CPU, in a LazyWeights whose layer matrices stored in
    # blocks (whatever ``quantization`` says) are made likewise. The monokernel, streaming
    # the groups, never reads those; code that casts the whole mapping keeps them unread
    # through lazy_weights.cast_mapping.
    weights: MutableMapping[str, torch.Tensor]
    tokenizer_dir: Path
    gguf_file: str | None  # set when the tokenizer lives inside a GGUF file
    eos_token_ids: tuple[int, ...]  # config's and generation_config's, deduplicated
    source: str
    # "fp8" when the checkpoint stored its weights as FP8 (weights/checkpoint_quant.py; they
    # are dequantised in ``weights``): the engine then quantises to fp8 by default. "int4"
    # when every layer linear weight is stored in 4 bits (GGUF Q4_0/Q4_1/Q4_K, AWQ, GPTQ; then
    # in ``groups``); "int8" when every one is stored in GGUF blocks and some in 5 to 8 bits
    # (Q8_0, Q6_K, Q5_K, Q5_0, Q5_1, alone or mixed with 4-bit ones as in Q4_K_M; then all in
    # ``groups`` as 8 bits, weights/gguf_8bit.py). Other GGUF files and unquantised
    # checkpoints: None.
    quantization: str | None = None
    # With quantization "int4" or "int8": each layer linear weight ("layers.{n}.wq", ...
    # w_down) as the checkpoint's own values (weights/group_quant.py), in HF row order; its
    # dense() is what ``weights`` holds for it (cast to the weights' dtype; a GGUF Q4_0
    # zero may differ in sign, a Q6_K value by an fp32 rounding: ``weights`` has gguf's
    # bits), and the only copy of that matrix until ``weights`` is read. On the device the
    # weights were read to (GGUF: the CPU). None otherwise.
    groups: Mapping[str, GroupQuant] | None = None
    # With quantization "fp8" and block scales (HF fine-grained FP8): each layer linear
    # weight's block scales, so the monokernel streams the checkpoint's own E4M3 values with
    # them (weights/formats/fp8.py). None otherwise.
    fp8_blocks: Fp8Blocks | None = None


@dataclass(frozen=True, slots=True)
class RunFormats:
    """What an engine's backend is handed besides the weights (construct_backend's
    arguments): the layers' ``quantize`` method, a checkpoint's own ``groups`` and FP8
    ``fp8_blocks``."""

    quantize: str | None = None
    groups: Mapping[str, GroupQuant] | None = None
    fp8_blocks: Fp8Blocks | None = None


def run_formats(ckpt: Checkpoint, quantize: str | None) -> RunFormats:
    """What ``monokernel run --model CKPT [--quantize QUANTIZE]`` hands its backend: the
    checkpoint's own quantisation unless --quantize names another (an FP8 checkpoint runs
    fp8, re-quantised one scale a row: for per-channel scales of each row's amax / 448,
    llm-compressor's min-max default, those are its own E4M3 values); its own groups where
    that method is theirs (a GGUF's 4- to 8-bit blocks, AWQ, GPTQ: --quantize of another
    method re-quantises); its FP8 block scales under fp8 (the checkpoint's own E4M3 values,
    not re-quantised a row)."""
    method = quantize if quantize is not None else ckpt.quantization
    groups = ckpt.groups if method == ckpt.quantization else None
    blocks = ckpt.fp8_blocks if method == "fp8" else None
    return RunFormats(method, groups, blocks)


def _local_hint(ref: str) -> str:
    return (
        f"to use a local copy instead, pass a directory holding config.json and "
        f"*.safetensors, or a .gguf file: monokernel run --model /path/to/model_dir "
        f"(was: {ref!r})"
    )


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local path, and loading from the HF hub needs "
            f"huggingface_hub (pip install 'monokernel[hub]'); {_local_hint(repo_id)}"
        ) from e
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated repo: all end the same way
        raise ModelNotFoundError(
            f"could not fetch {repo_id!r} from the HF hub ({type(e).__name__}: {e}); "
            + _local_hint(repo_id)
        ) from e


def _eos_ids(model_dir: Path, cfg: ModelConfig) -> tuple[int, ...]:
    ids = list(cfg.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        ids += [value] if isinstance(value, int) else list(value or [])
    return tuple(dict.fromkeys(int(i) for i in ids))


def _load_gguf(
    path: Path, progress: bool = False, before_weights: BeforeWeights = None
) -> Checkpoint:
    from monokernel.weights.gguf_loader import (
        gguf_generation_eos_ids,
        load_gguf_config,
        load_gguf_tensors,
    )
    from monokernel.weights.progress import format_bytes, slow_step

    cfg = load_gguf_config(path)
    if before_weights is not None:
        before_weights(cfg, Announced())
    eos = tuple(dict.fromkeys((*cfg.eos_token_ids, *gguf_generation_eos_ids(path))))
    # Decoding the blocks runs on the CPU: 0.6 s for the default model's 98 MB on 2 cores,
    # so seconds for a GGUF of a few GB. The layer matrices' float32 values are made only
    # if an engine reads them (weights/lazy_weights.py).
    size = format_bytes(path.stat().st_size)
    with slow_step(f"loading weights: decoding {path.name} ({size})", progress):
        weights, groups = load_gguf_tensors(path, cfg)
    whole = _every_layer_linear(groups, cfg)
    streamed = None
    if whole:
        from monokernel.weights.gguf_8bit import uniform_groups
        from monokernel.weights.quantize import groups_method

        streamed = uniform_groups(groups)
    return Checkpoint(
        config=cfg,
        weights=weights,
        tokenizer_dir=path.parent,
        gguf_file=path.name,
        eos_token_ids=eos,
        source=str(path),
        quantization=None if streamed is None else groups_method(streamed),
        groups=streamed,
    )


def _every_layer_linear(groups: Mapping[str, object], cfg: ModelConfig) -> bool:
    """Whether ``groups`` holds each of every layer's seven linear weights: the engine
    streams a model in 4 bits only whole (a GGUF Q4_K_M mixes in Q6_K matrices, an AWQ
    checkpoint may leave modules unquantised)."""
    from monokernel.weights.quantize import LINEAR_NAMES

    return all(f"layers.{n}.{m}" in groups for n in range(cfg.num_layers) for m in LINEAR_NAMES)


def _load_hf_dir(
    model_dir: Path,
    progress: bool,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
    before_weights: BeforeWeights = None,
) -> Checkpoint:
    from monokernel.weights.checkpoint_quant import (
        CHECKPOINT_FP8,
        CheckpointQuant,
        Int4Quant,
        parse_quantization_config,
    )
    from monokernel.weights.safetensors_loader import (
        check_group_indices,
        load_safetensors_tensors,
    )

    cfg = load_hf_config(model_dir)
    # ModelConfig keeps the architecture only: the scheme is read from the file again, and
    # one we cannot read is refused before the memory plan or any weight.
    quant = parse_quantization_config(json.loads((model_dir / "config.json").read_text()))
    if isinstance(quant, Int4Quant):
        check_group_indices(model_dir, quant)
    if before_weights is not None:
        if isinstance(quant, Int4Quant):
            announced = Announced(CHECKPOINT_INT4, quant.group)
        elif isinstance(quant, CheckpointQuant):
            announced = Announced(CHECKPOINT_FP8)
        else:
            announced = Announced()
        before_weights(cfg, announced)
    weights, groups, blocks = load_safetensors_tensors(
        model_dir, cfg, device=device, dtype=dtype, progress=progress, quant=quant
    )
    int4 = isinstance(quant, Int4Quant) and _every_layer_linear(groups, cfg)
    fp8 = isinstance(quant, CheckpointQuant) and _has_float8(model_dir)
    return Checkpoint(
        config=cfg,
        weights=weights,
        tokenizer_dir=model_dir,
        gguf_file=None,
        eos_token_ids=_eos_ids(model_dir, cfg),
        source=str(model_dir),
        quantization=CHECKPOINT_INT4 if int4 else CHECKPOINT_FP8 if fp8 else None,
        groups=groups if int4 else None,
        fp8_blocks=blocks if fp8 and blocks and _every_layer_linear(blocks.scales, cfg) else None,
    )


def _has_float8(model_dir: Path) -> bool:
    """Whether any tensor is stored as float8: a config can keep a quantization_config
    after its weights were converted back to bf16. Headers only (already read once)."""
    from monokernel.weights.checkpoint_quant import FLOAT8_DTYPES
    from monokernel.weights.safetensors_loader import read_header, safetensors_files

    files = safetensors_files(model_dir)
    return any(e.dtype in FLOAT8_DTYPES for f in files for e in read_header(f))


def resolve_model_path(ref: str | Path | None, progress: bool = True) -> Path:
    """A local file or directory for ``ref``, downloading only what must be downloaded."""
    if ref is None:
        from monokernel.weights.default_model import default_model_path

        return default_model_path(progress=progress)
    path = Path(ref).expanduser()
    if path.exists():
        return path
    if isinstance(ref, str) and _HUB_ID.match(ref) and not ref.endswith(".gguf"):
        return _download_from_hub(ref)
    raise ModelNotFoundError(
        f"model {str(ref)!r} does not exist; accepted: a local HF directory (config.json + "
        "*.safetensors), a .gguf file, or an HF hub id like 'HuggingFaceTB/SmolLM2-135M-Instruct'"
    )


def reads_gguf(path: Path) -> bool:
    """Whether load_checkpoint reads ``path`` (resolved: resolve_model_path) as a GGUF, a
    file or a folder without config.json: its weights then stay on the host whatever device
    it is given, until a caller casts them."""
    return path.is_file() or not (path / "config.json").is_file()


def load_checkpoint(
    ref: str | Path | None,
    progress: bool = True,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    before_weights: BeforeWeights = None,
) -> Checkpoint:
    """Config, weights and tokenizer location of ``ref``.

    ``before_weights`` is called with the config and what it announces of the checkpoint's
    quantisation (Announced) once it is read and before any weight is (the engine's memory
    plan refuses a model that cannot fit before copying it).

    ``progress``: download bars, a loading bar for safetensors when stderr is a terminal,
    and a line on stderr when a GGUF's dequantisation takes over a second.
    ``device``/``dtype``: where safetensors weights are read to, tensor by tensor, so a
    large model never sits on the CPU whole (an AWQ/GPTQ checkpoint's layer matrices as
    their groups there, made dense only when read); GGUF weights stay on the CPU (their
    dequantisation runs there).
    """
    path = resolve_model_path(ref, progress=progress)
    if not reads_gguf(path):
        return _load_hf_dir(path, progress, device, dtype, before_weights)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(
                f"{path} is a file but not a .gguf; pass a .gguf file or a directory"
            )
        return _load_gguf(path, progress, before_weights)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _load_gguf(ggufs[0], progress, before_weights)
    raise ModelNotFoundError(
        f"{path} has no config.json"
        + (f" and several .gguf files ({[g.name for g in ggufs]}); name one" if ggufs else "")
    )
