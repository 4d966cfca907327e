"""The generated tokens' log-probabilities in OpenAI's two shapes.

Chat (``logprobs: true``, ``top_logprobs: N``): ``{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}``, one entry a token.
Completions (``logprobs: N``): four parallel lists, ``tokens``, ``token_logprobs``,
``top_logprobs`` (a ``{token: logprob}`` map a token) and ``text_offset`` (where each token's
text starts in the completion). A token's text is what it decodes to alone (a piece of a
multi-byte character decodes to U+FFFD; its ``bytes`` are of that text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from monokernel.runtime.logprobs import TokenLogprobs
from monokernel.tokenizer.tokenizer import Tokenizer


class LogprobsFormat:
    """One response's formatter (it keeps the completion's running text offset)."""

    def __init__(self, tokenizer: Tokenizer, chat: bool, start_offset: int = 0) -> None:
        self._tok = tokenizer
        self.chat = chat
        self._offset = start_offset
        self._texts: dict[int, str] = {}

    def _text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self._tok.decode([token])
        return text

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self._text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def format(self, items: Sequence[tuple[int, TokenLogprobs]]) -> dict[str, Any]:
        """The ``logprobs`` of a choice (or of one chunk) holding ``items``' tokens."""
        if self.chat:
            content = [
                self._entry(t, lp.logprob)
                | {"top_logprobs": [self._entry(i, v) for i, v in lp.top]}
                for t, lp in items
            ]
            return {"content": content}
        tokens, offsets = [], []
        for t, _ in items:
            tokens.append(self._text(t))
            offsets.append(self._offset)
            self._offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for _, lp in items],
            "top_logprobs": [{self._text(i): v for i, v in lp.top} for _, lp in items],
            "text_offset": offsets,
        }
