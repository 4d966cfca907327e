"""The model's own tokenizer and chat template, through `transformers.AutoTokenizer`.

Using HF's tokenizer is deliberate: a raw prompt must tokenise exactly as `transformers`
does by default, and a chat must go through the checkpoint's own template.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from monokernel.errors import InvalidRequestError, ModelNotFoundError

ChatMessage = dict[str, Any]
Prompt = str | Sequence[ChatMessage]


class Tokenizer:
    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer

    @classmethod
    def load(cls, directory: Path, gguf_file: str | None = None) -> Tokenizer:
        import transformers

        kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
        try:
            hf = transformers.AutoTokenizer.from_pretrained(str(directory), **kwargs)
        except (OSError, ValueError) as e:
            where = f"{directory}/{gguf_file}" if gguf_file else str(directory)
            raise ModelNotFoundError(f"could not load a tokenizer from {where}: {e}") from e
        return cls(hf)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """As `transformers` does by default: special tokens (BOS) added where the model
        adds them."""
        return list(self.hf(text, add_special_tokens=True)["input_ids"])

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        if not self.has_chat_template:
            raise InvalidRequestError(
                "this model's tokenizer has no chat template; send a plain prompt instead"
            )
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidRequestError(
                    "each chat message must be an object with 'role' and 'content'"
                )
        text = self.hf.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
        # The template already wrote BOS and the like as text.
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt)
        return self.encode_chat(prompt)

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)
