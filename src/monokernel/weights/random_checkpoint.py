"""Write a random-weight HF checkpoint directory in a named real shape, with a tokenizer.

    python -m monokernel.weights.random_checkpoint OUTDIR --shape qwen2.5-coder-1.5b
        [--vocab-from-tokenizer] [--seed S] [--logit-scale X] [--device cpu|cuda]

**This is not a model.** It is for smoke-testing the paths that need a model *directory*
(`monokernel run --model DIR`, `monokernel serve DIR`, `--tp N`) on a machine without
network, where no real checkpoint can be downloaded, in shapes whose head counts the real
checkpoint we can carry (SmolLM2-135M, 9 heads / 3 KV heads) does not have. The text it
generates is meaningless.

OUTDIR gets what a real HF directory of the shape's family holds and our loader reads:

- ``config.json``: the shape's architecture (``models/shapes.py``) with the fields a real
  config of that family has; ``vocab_size`` is the tokenizer's size (below);
- ``generation_config.json``: the EOS ids (``<|im_end|>``, ``<|endoftext|>``);
- ``model.safetensors``: random bf16 weights (``weights/random_weights.py``) under the HF
  tensor names (``weights.names.ours_to_hf``). The LM head rows of the special tokens
  (the embedding rows when tied) are zero, so their logit is exactly 0, below the maximum
  of the random logits: a random model practically never emits EOS, and requests run to
  ``max_tokens``;
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
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from monokernel.models.config import ModelConfig, config_from_hf_dict, hf_core_fields
from monokernel.models.shapes import SHAPES
from monokernel.weights.names import Weights, ours_to_hf
from monokernel.weights.random_weights import random_weights

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BASE_VOCAB = 256 + len(SPECIAL_TOKENS)  # the bytes, then the specials
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 256, 257, 258
VOCAB_MULTIPLE = 64
MARKER = "RANDOM_WEIGHTS.txt"
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
    """Random bf16 weights on the CPU, our names; the special tokens' LM-head rows zeroed."""
    weights = random_weights(cfg, device=device, seed=seed, logit_scale=logit_scale)
    head = "embed" if cfg.tie_word_embeddings else "lm_head"
    weights[head][ENDOFTEXT_ID : IM_END_ID + 1] = 0
    return {name: t.to("cpu").contiguous() for name, t in weights.items()}


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
) -> Weights:
    """Write the directory (module docstring); returns the weights written (our names)."""
    from safetensors.torch import save_file

    outdir = Path(outdir)
    _check_outdir(outdir)
    cfg = checkpoint_config(shape, vocab_from_tokenizer)
    config = hf_config_dict(cfg)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "model.safetensors.index.json").unlink(missing_ok=True)
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
    save_file(
        {ours_to_hf(name): t for name, t in weights.items()},
        str(outdir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return weights


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m monokernel.weights.random_checkpoint",
        description="Write a random-weight HF checkpoint (config, safetensors, tokenizer) in a "
        "named real shape, for smoke tests without network. Not a model.",
    )
    p.add_argument("outdir", type=Path, help="directory to create (new or empty)")
    p.add_argument("--shape", required=True, help=f"one of: {', '.join(SHAPES)}")
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
    p.add_argument("--device", default="cpu", help="where to draw the random numbers (cpu|cuda)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.shape not in SHAPES:
        p.error(f"unknown shape {args.shape!r}; known shapes: {', '.join(SHAPES)}")
    from monokernel.weights.shard import valid_tp_sizes

    try:
        weights = write_random_checkpoint(
            args.outdir,
            SHAPES[args.shape],
            seed=args.seed,
            logit_scale=args.logit_scale,
            vocab_from_tokenizer=args.vocab_from_tokenizer,
            device=args.device,
            shape_name=args.shape,
        )
    except ValueError as e:
        print(f"random_checkpoint: error: {e}", file=sys.stderr)
        return 1
    cfg = checkpoint_config(SHAPES[args.shape], args.vocab_from_tokenizer)
    n = sum(t.numel() for t in weights.values())
    print(
        f"wrote {args.outdir}: {args.shape} shape ({cfg.family}, {cfg.num_layers} layers, "
        f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads, vocab {cfg.vocab_size}), "
        f"{n / 1e6:.1f} M random bf16 parameters; valid --tp sizes: "
        f"{', '.join(map(str, valid_tp_sizes(cfg)))}. Random weights: not a model."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
