"""Streaming text out of a token stream without ever emitting half a character.

A byte-level BPE token may end in the middle of a UTF-8 sequence, and SentencePiece tokens
change their leading space depending on what precedes them; so each step decodes a short
window of ids and emits only the text the window *added*, holding back a trailing U+FFFD.
"""

from __future__ import annotations

from collections.abc import Sequence

from monokernel.tokenizer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_CONTEXT = 4  # prompt ids kept as left context so the first token decodes as in a sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> None:
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self.prefix = 0  # start of the decode window
        self.read = len(self.ids)  # ids before this are already emitted as text

    def add(self, token_id: int) -> str:
        """The text this token completes (may be empty)."""
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self.prefix : self.read])
        after = self.tok.decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith(_REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """At the end: whatever complete text is still held back."""
        before = self.tok.decode(self.ids[self.prefix : self.read])
        after = self.tok.decode(self.ids[self.prefix :]).rstrip(_REPLACEMENT)
        self.prefix = self.read = len(self.ids)
        return after[len(before) :] if len(after) > len(before) else ""
