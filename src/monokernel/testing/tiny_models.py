"""Tiny random HF checkpoints of every supported family, written with `save_pretrained`.

Used by the tests of every layer; odd sizes on purpose (hidden not a power of two, head_dim
not hidden/heads, GQA). Weights use a wide init so logits are peaked and greedy decoding
has no near-ties to flip.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# family name -> (HF model_type, config overrides)
TINY_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": (
        "llama",
        {"rope_parameters": {"rope_theta": 500000.0, **LLAMA3_ROPE}, "tie_word_embeddings": False},
    ),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-bias": ("llama", {"attention_bias": True}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 24, "tie_word_embeddings": False}),
}


def tiny_hf_config(family: str, vocab_size: int = 131, sizes: dict[str, Any] | None = None) -> Any:
    """``sizes``: HF config fields over the tiny defaults (e.g. a GPU test's kernel-sized
    ``hidden_size``)."""
    import transformers

    model_type, overrides = TINY_FAMILIES[family]
    base: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 72,
        "intermediate_size": 100,
        "num_hidden_layers": 3,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    base |= overrides | (sizes or {})
    return transformers.AutoConfig.for_model(model_type, **base)


def make_tiny_checkpoint(
    family: str,
    directory: Path,
    seed: int = 0,
    scale: float = 0.15,
    vocab_size: int = 131,
    sizes: dict[str, Any] | None = None,
) -> Path:
    """Write a random checkpoint of ``family`` into ``directory``; returns it."""
    import transformers

    torch.manual_seed(seed)
    cfg = tiny_hf_config(family, vocab_size, sizes)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(scale * torch.randn_like(p))
    model.save_pretrained(directory)
    return directory


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "def reverse(s):\n    return s[::-1]\n",
    "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 日本語 テキスト",
    "for i in range(10):\n    print(i * i)\n",
    "import torch\nx = torch.zeros(3)\n",
] * 20


def make_tiny_tokenizer(
    directory: Path, vocab_size: int = 320, extra_specials: Sequence[str] = ()
) -> int:
    """A byte-level BPE tokenizer with ChatML specials (and ``extra_specials``, e.g.
    Mistral's ``[TOOL_CALLS]``) saved into ``directory``; returns its size (the model's
    vocab must match)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_specials]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token=None, pad_token="<|endoftext|>"
    )
    if extra_specials:  # skipped when decoding, as real tokenizers skip their markers
        fast.add_special_tokens({"additional_special_tokens": list(extra_specials)})
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(directory)
    return len(fast)


def make_tiny_model_dir(
    family: str,
    directory: Path,
    seed: int = 0,
    sizes: dict[str, Any] | None = None,
    extra_specials: Sequence[str] = (),
) -> Path:
    """A complete tiny model directory: checkpoint + tokenizer + chat template."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = make_tiny_tokenizer(directory, extra_specials=extra_specials)
    make_tiny_checkpoint(family, directory, seed=seed, vocab_size=vocab, sizes=sizes)
    eos = transformers.AutoTokenizer.from_pretrained(directory).convert_tokens_to_ids("<|im_end|>")
    import json

    cfg_path = directory / "config.json"
    cfg = json.loads(cfg_path.read_text()) | {"eos_token_id": eos, "bos_token_id": None}
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (directory / "generation_config.json").unlink(missing_ok=True)
    return directory
