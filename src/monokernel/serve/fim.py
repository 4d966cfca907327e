"""Fill in the middle: a completion request's ``suffix``, for models trained with FIM tokens.

The prompt is laid out prefix-suffix-middle, as the coding models that have these tokens
were trained and as code-completion clients expect: ``<prefix marker> prompt <suffix
marker> suffix <middle marker>``; the model then writes what goes between prompt and
suffix. A model whose tokenizer has none of the known marker triples gets a 400 naming
``suffix``: the field is never ignored.
"""

from __future__ import annotations

from typing import Any

from monokernel.runtime.engine import Engine
from monokernel.serve.errors import bad_request
from monokernel.serve.protocol import unwrap_prompt

# (prefix, suffix, middle) markers, each family's spelling in its vocabulary.
FIM_MARKERS: tuple[tuple[str, str, str], ...] = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)


def fim_markers(hf: Any) -> tuple[int, int, int] | None:
    """The ids of the first known marker triple the tokenizer holds whole, else None."""
    vocab = hf.get_vocab()
    for names in FIM_MARKERS:
        ids = [vocab.get(n) for n in names]
        if all(i is not None for i in ids):
            return (int(ids[0]), int(ids[1]), int(ids[2]))  # type: ignore[arg-type]
    return None


def fim_prompt(engine: Engine, prompt: Any, suffix: str) -> list[int]:
    """The token ids of a fill-in-the-middle prompt (blocking: call it off the event loop);
    a 400 where the model has no FIM tokens or the prompt is not one text."""
    prompt = unwrap_prompt(prompt)
    if not isinstance(prompt, str):
        raise bad_request("suffix takes one text prompt, not token ids or a list", "suffix")
    hf = engine.tokenizer.hf
    markers = fim_markers(hf)
    if markers is None:
        known = ", ".join(" ".join(names) for names in FIM_MARKERS)
        raise bad_request(
            "suffix (fill in the middle) needs a model with FIM tokens; this model's "
            f"tokenizer has none of: {known}",
            "suffix",
        )
    begin, hole, middle = markers

    def text(t: str) -> list[int]:
        return list(hf(t, add_special_tokens=False)["input_ids"])

    return [begin, *text(prompt), hole, *text(suffix), middle]
