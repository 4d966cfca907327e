"""Write a random-weight HF checkpoint directory in a named real shape, with a tokenizer.

    python -m monokernel.weights.random_checkpoint OUTDIR --shape qwen2.5-coder-1.5b
        [--vocab-from-tokenizer] [--seed S] [--logit-scale X] [--device cpu|cuda]
        [--shard-size 5GB]

**This is not a model.** It is for smoke-testing the paths that need a model *directory*
(`monokernel run --model DIR`, `monokernel serve DIR`, `--tp N`) on a machine without
network, where no real checkpoint can be downloaded, in shapes whose head counts the real
checkpoint we can carry (SmolLM2-135M, 9 heads / 3 KV heads) does not have, and for timing
the load of a large one (``python -m monokernel.weights.load_time``). The text it
generates is meaningless.

OUTDIR gets what a real HF directory of the shape's family holds and our loader reads:

- ``config.json``: the shape's architecture (``models/shapes.py``) with the fields a real
  config of that family has; ``vocab_size`` is the tokenizer's size (below);
- ``generation_config.json``: the EOS ids (``<|im_end|>``, ``<|endoftext|>``);
- random bf16 weights (``weights/random_weights.py``) under the HF tensor names
  (``weights.names.ours_to_hf``), in safetensors shards of at most ``--shard-size`` (5 GB,
  HF's default) as HF writes them: ``model.safetensors`` when one shard holds everything,
  else ``model-00001-of-0000N.safetensors`` ... with ``model.safetensors.index.json``.
  Tensors are copied to the host and written one at a time, so writing an 8B model
  generated with ``--device cuda`` holds no second copy of it anywhere. The LM head rows
  of the special tokens (the embedding rows when tied) are zero, so their logit is
  exactly 0, below the maximum of the random logits: a random model practically never
  emits EOS, and requests run to ``max_tokens``;
- a byte-level BPE tokenizer built here with ``tokenizers`` (nothing downloaded):
  ids 0-255 are the 256 bytes (no merges, so every text encodes to its UTF-8 bytes), then
  ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, then filler tokens up to the model's
  vocabulary, which encoding never produces and which decode to `` t<id>``; saved with a
  ChatML chat template through ``transformers`` (``tokenizer.json``,
  ``tokenizer_config.json``);
- ``RANDOM_WEIGHTS.txt``, saying what this is (and marking OUTDIR as ours: a non-empty
  OUTDIR without it is refused).

By default the vocabulary is the shape's real one (151,936 ids for Qwen2.5), so the LM head
has its real size; ``--vocab-from-tokenizer`` shrinks it to the 259 real tokens rounded up
to a multiple of 64 (320), for a smaller file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import struct
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from monokernel.models.config import ModelConfig, config_from_hf_dict, hf_core_fields
from monokernel.models.shapes import DENSE_SHAPES
from monokernel.weights.names import Weights, ours_to_hf
from monokernel.weights.progress import format_bytes
from monokernel.weights.random_weights import random_weights
from monokernel.weights.safetensors_loader import INDEX_FILE, SINGLE_FILE, ST_DTYPE_NAMES

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BASE_VOCAB = 256 + len(SPECIAL_TOKENS)  # the bytes, then the specials
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 256, 257, 258
VOCAB_MULTIPLE = 64
MARKER = "RANDOM_WEIGHTS.txt"
DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' max_shard_size="5GB"
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of ByteLevel pre-tokenizers."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    out: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def tokenizer_vocab(vocab_size: int) -> dict[str, int]:
    """Token string -> id: the 256 bytes (id = byte), the specials, then fillers."""
    if vocab_size < BASE_VOCAB:
        raise ValueError(f"vocab_size={vocab_size} is below the tokenizer's {BASE_VOCAB} tokens")
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab |= {tok: 256 + k for k, tok in enumerate(SPECIAL_TOKENS)}
    space = _bytes_to_unicode()[ord(" ")]  # "Ġ": fillers decode to " t<id>"
    vocab |= {f"{space}t{i}": i for i in range(BASE_VOCAB, vocab_size)}
    assert len(vocab) == vocab_size
    return vocab


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """Save a byte-level BPE tokenizer of exactly ``vocab_size`` tokens into ``directory``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=tokenizer_vocab(vocab_size), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(directory))


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json a real HF checkpoint of ``cfg``'s family and sizes would have;
    refuses a config our parser would read back differently."""
    d: dict[str, Any] = {"architectures": [_ARCHITECTURES[cfg.family]]} | hf_core_fields(cfg)
    d.setdefault("rope_scaling", None)
    d |= {
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "eos_token_id": (
            cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids)
        ),
    }
    if cfg.family in ("llama", "mistral", "qwen3"):
        d["attention_bias"] = cfg.qkv_bias
    if cfg.family == "llama":
        d |= {"mlp_bias": False, "pretraining_tp": 1}
    if cfg.family in ("qwen2", "qwen3"):
        d |= {"max_window_layers": cfg.num_layers, "use_sliding_window": False}
    # Qwen2's configs carry a window that use_sliding_window=false switches off.
    d["sliding_window"] = cfg.max_position_embeddings if cfg.family == "qwen2" else None
    back = config_from_hf_dict(json.loads(json.dumps(d)))
    if back != cfg:
        raise ValueError(
            f"a {cfg.family} config.json cannot express this shape (it reads back as {back})"
        )
    return d


def padded_vocab(n: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


def checkpoint_config(shape: ModelConfig, vocab_from_tokenizer: bool = False) -> ModelConfig:
    """``shape`` with our tokenizer's vocabulary size and special token ids."""
    vocab = padded_vocab(BASE_VOCAB) if vocab_from_tokenizer else shape.vocab_size
    if vocab < BASE_VOCAB:
        raise ValueError(
            f"the shape's vocab_size={vocab} is below the tokenizer's {BASE_VOCAB} tokens; "
            "use --vocab-from-tokenizer"
        )
    return dataclasses.replace(
        shape, vocab_size=vocab, bos_token_id=ENDOFTEXT_ID, eos_token_ids=(ENDOFTEXT_ID,)
    )


def make_weights(
    cfg: ModelConfig, seed: int = 0, logit_scale: float = 8.0, device: str = "cpu"
) -> Weights:
    """Random bf16 weights on ``device``, our names; the special tokens' LM-head rows zeroed.

    They stay where they were drawn: the writer copies them to the host one at a time.
    """
    weights = random_weights(cfg, device=device, seed=seed, logit_scale=logit_scale)
    head = "embed" if cfg.tie_word_embeddings else "lm_head"
    weights[head][ENDOFTEXT_ID : IM_END_ID + 1] = 0
    return weights


def parse_size(text: str) -> int:
    """Bytes in ``5GB`` (decimal, as transformers' ``max_shard_size``), ``512MiB`` or
    ``1000``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size; use e.g. 5GB, 500MB, 2GiB or a byte count")
    size = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if size < 1:
        raise ValueError(f"size {text!r} must be at least one byte")
    return size


def hf_order(name: str) -> tuple[int, int]:
    """Embedding, then layer by layer, then the final norm and LM head: the order of a
    model's state dict, which is how transformers fills its shards."""
    if name == "embed":
        return (0, 0)
    if name.startswith("layers."):
        return (1, int(name.split(".")[1]))
    return (2, 0)


def plan_shards(sizes: Sequence[tuple[str, int]], shard_bytes: int) -> list[list[str]]:
    """Names grouped in order into shards of at most ``shard_bytes``, as transformers
    groups them: a tensor larger than that gets a shard to itself."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, n in sizes:
        if shards[-1] and used + n > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    return shards


def write_safetensors(
    path: Path, tensors: Sequence[tuple[str, torch.Tensor]], metadata: dict[str, str]
) -> int:
    """One safetensors file, streaming each tensor from wherever it lives: the host holds
    one tensor at a time, where ``safetensors.torch.save_file`` wants all of them on the
    CPU and then serialises a second copy. Returns the bytes of tensor data written."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": ST_DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format's padding: tensor data starts 8-aligned
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for _, t in tensors:
            host = t.detach().to("cpu").contiguous().reshape(-1)
            fh.write(memoryview(host.view(torch.uint8).numpy()))
    return offset


def write_weights(outdir: Path, weights: Weights, shard_bytes: int) -> list[str]:
    """The weights as HF names them, in one file or in shards with an index; returns the
    file names written."""
    order = sorted(weights, key=hf_order)
    sizes = [(name, weights[name].numel() * weights[name].element_size()) for name in order]
    shards = plan_shards(sizes, shard_bytes)
    if len(shards) == 1:
        files = [SINGLE_FILE]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = 0
    weight_map: dict[str, str] = {}
    for fname, names in zip(files, shards, strict=True):
        tensors = [(ours_to_hf(name), weights[name]) for name in names]
        total += write_safetensors(outdir / fname, tensors, {"format": "pt"})
        weight_map |= {hf: fname for hf, _ in tensors}
    if len(files) > 1:
        # Written last: a directory cut short while writing has no index naming its shards.
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (outdir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files


def _check_outdir(outdir: Path) -> None:
    if outdir.exists() and not outdir.is_dir():
        raise ValueError(f"{outdir} exists and is not a directory")
    if outdir.is_dir() and any(outdir.iterdir()) and not (outdir / MARKER).is_file():
        raise ValueError(
            f"{outdir} is not empty and was not written by this tool (no {MARKER}); "
            "pass an empty or new directory"
        )


def write_random_checkpoint(
    outdir: str | Path,
    shape: ModelConfig,
    *,
    seed: int = 0,
    logit_scale: float = 8.0,
    vocab_from_tokenizer: bool = False,
    device: str = "cpu",
    shape_name: str = "custom",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Weights:
    """Write the directory (module docstring); returns the weights written (our names, on
    ``device``)."""
    outdir = Path(outdir)
    _check_outdir(outdir)
    cfg = checkpoint_config(shape, vocab_from_tokenizer)
    config = hf_config_dict(cfg)
    outdir.mkdir(parents=True, exist_ok=True)
    # Rewriting our own directory: shards of an earlier, differently sharded write would
    # otherwise be read as part of this one when there is no index.
    (outdir / INDEX_FILE).unlink(missing_ok=True)
    for old in outdir.glob("*.safetensors"):
        old.unlink()
    (outdir / MARKER).write_text(
        f"Random weights in the {shape_name} shape (seed {seed}, logit scale {logit_scale}), "
        "written by python -m monokernel.weights.random_checkpoint.\n"
        "NOT a model: for smoke-testing monokernel's CLI and server paths without network.\n"
    )
    (outdir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (outdir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ENDOFTEXT_ID, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID]}) + "\n"
    )
    write_tokenizer(outdir, cfg.vocab_size)
    weights = make_weights(cfg, seed=seed, logit_scale=logit_scale, device=device)
    write_weights(outdir, weights, shard_bytes)
    return weights


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m monokernel.weights.random_checkpoint",
        description="Write a random-weight HF checkpoint (config, safetensors, tokenizer) in a "
        "named real shape, for smoke tests without network. Not a model.",
    )
    p.add_argument("outdir", type=Path, help="directory to create (new or empty)")
    p.add_argument("--shape", required=True, help=f"one of: {', '.join(DENSE_SHAPES)}")
    p.add_argument(
        "--vocab-from-tokenizer",
        action="store_true",
        help=f"vocab_size = the tokenizer's {BASE_VOCAB} real tokens rounded up to a multiple "
        f"of {VOCAB_MULTIPLE}, instead of the shape's vocab_size",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--logit-scale",
        type=float,
        default=8.0,
        help="scale of the LM head: larger spreads the logits (fewer greedy near-ties)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where to draw the random numbers (cpu|cuda); cuda for 7B and up, where the "
        "CPU takes minutes",
    )
    p.add_argument(
        "--shard-size",
        default="5GB",
        help="most bytes per safetensors file, e.g. 5GB (the default, as transformers "
        "writes), 500MB, 2GiB; one file when everything fits",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.shape not in DENSE_SHAPES:
        p.error(f"unknown shape {args.shape!r}; known shapes: {', '.join(DENSE_SHAPES)}")
    try:
        shard_bytes = parse_size(args.shard_size)
    except ValueError as e:
        p.error(f"--shard-size: {e}")
    from monokernel.weights.shard import valid_tp_sizes

    start = time.perf_counter()
    try:
        weights = write_random_checkpoint(
            args.outdir,
            DENSE_SHAPES[args.shape],
            seed=args.seed,
            logit_scale=args.logit_scale,
            vocab_from_tokenizer=args.vocab_from_tokenizer,
            device=args.device,
            shape_name=args.shape,
            shard_bytes=shard_bytes,
        )
    except ValueError as e:
        print(f"random_checkpoint: error: {e}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    cfg = checkpoint_config(DENSE_SHAPES[args.shape], args.vocab_from_tokenizer)
    n = sum(t.numel() for t in weights.values())
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    shards = len(list(args.outdir.glob("*.safetensors")))
    print(
        f"wrote {args.outdir}: {args.shape} shape ({cfg.family}, {cfg.num_layers} layers, "
        f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads, vocab {cfg.vocab_size}), "
        f"{n / 1e6:.1f} M random bf16 parameters ({format_bytes(nbytes)} in {shards} "
        f"shard{'' if shards == 1 else 's'}, {seconds:.1f} s); valid --tp sizes: "
        f"{', '.join(map(str, valid_tp_sizes(cfg)))}. Random weights: not a model."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
