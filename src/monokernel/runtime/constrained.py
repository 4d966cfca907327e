"""Grammar-constrained decoding: a JSON schema, a regex or a Lark grammar the output must
match, enforced token by token with llguidance.

Each decode step the request's ``TokenMatcher`` gives the set of tokens that keep the
output a prefix of the grammar's language; the backend sets every other logit to -inf
before the sampling rule (runtime/sampling.py), so greedy and sampled decoding both draw
only grammatical tokens, and the chosen token is fed back. An EOS id is allowed exactly
when the grammar accepts what has been written, so a constrained request ends with EOS
(or at ``max_tokens``, cut short like any other).

llguidance is optional (``pip install "monokernel[structured]"``): it is imported only
when a constrained request is made, so ``monokernel run``, ``bench`` and the GPU tests
never need it. The torch and reference engines apply the mask to the logits on the host;
the monokernel stays in its loop and reads each step's mask in its LM head, sent by the
host while the kernel runs the step's layers
(runtime/backends/monokernel/grammar_mask.py); not at --tp > 1 yet.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from monokernel.errors import InvalidRequestError
from monokernel.runtime.sampling import SamplingParams, sample

if TYPE_CHECKING:
    import llguidance

log = logging.getLogger("monokernel.constrained")

INSTALL_HINT = 'pip install "monokernel[structured]"'
# Engines that apply a mask: the torch and reference engines on the host once a token, the
# monokernel in its LM head from masks the host sends a step ahead (one GPU).
CONSTRAINED_ENGINES = ("reference", "torch", "monokernel")
# json.dumps's separators: what models have seen most, and no free whitespace for a model
# (random weights, in the tests) to fill a whole context with.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

Kind = Literal["json_schema", "regex", "lark", "choice"]


class ConstraintError(InvalidRequestError):
    """The constraint cannot be enforced: a grammar llguidance refuses (an unsupported
    JSON-schema keyword, a bad regex), or llguidance is not installed."""


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match. ``source``: the JSON schema as JSON text, the regex,
    the Lark grammar, or the choices as a JSON list of strings."""

    kind: Kind
    source: str

    @staticmethod
    def json_schema(schema: dict[str, Any] | bool) -> Constraint:
        return Constraint("json_schema", json.dumps(schema))

    @staticmethod
    def json_object() -> Constraint:
        """Any JSON object (OpenAI's ``response_format`` ``json_object``)."""
        return Constraint.json_schema({"type": "object"})

    @staticmethod
    def regex(pattern: str) -> Constraint:
        return Constraint("regex", pattern)

    @staticmethod
    def lark(grammar: str) -> Constraint:
        """A Lark grammar in llguidance's dialect (``%json {...}`` embeds a schema)."""
        return Constraint("lark", grammar)

    @staticmethod
    def choice(options: Iterable[str]) -> Constraint:
        return Constraint("choice", json.dumps(list(options)))

    def grammar(self) -> str:
        """llguidance's grammar text for this constraint."""
        lib = require_llguidance()
        matcher = lib.LLMatcher
        if self.kind == "json_schema":
            return str(matcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS))
        if self.kind == "regex":
            return str(matcher.grammar_from_regex(self.source))
        if self.kind == "lark":
            return str(matcher.grammar_from_lark(self.source))
        options = json.loads(self.source)
        return str(matcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, options))))


def require_llguidance() -> Any:
    """The llguidance module, or ConstraintError saying how to install it."""
    try:
        import llguidance
        import llguidance.hf  # the HF tokenizer adapter, a module of its own
    except ImportError as e:
        raise ConstraintError(
            "constrained decoding (structured output, tool_choice 'required' or a named "
            f"function) needs llguidance, which is not installed: {INSTALL_HINT}"
        ) from e
    return llguidance


def unsupported_reason(engine: str) -> str | None:
    """Why an engine cannot run a constrained request, or None when it can. (Under
    --speculative it decodes without drafts: Speculating.drafting.)"""
    if engine not in CONSTRAINED_ENGINES:
        return (
            f"constrained decoding runs on the {', '.join(CONSTRAINED_ENGINES)} engines; this "
            f"server runs the {engine} engine"
        )
    return None


class GrammarCompiler:
    """One tokenizer's llguidance view (built once: ~1 s for a large vocabulary) and the
    matchers made from it. Thread-safe: the server compiles on its tokenizer thread to
    check a request and again on the engine thread to run it."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self._hf = hf_tokenizer
        # The model's vocabulary may be padded past the tokenizer's: the mask covers the
        # logits, and the padding is never allowed.
        self.vocab_size = max(vocab_size, len(hf_tokenizer))
        self.eos_ids = sorted(set(eos_ids))
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def _lltokenizer(self) -> llguidance.LLTokenizer:
        lib = require_llguidance()
        with self._lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = lib.hf.from_tokenizer(
                        self._hf, n_vocab=self.vocab_size, eos_token=self.eos_ids
                    )
                except ValueError as e:  # a slow (Python) tokenizer
                    raise ConstraintError(
                        f"constrained decoding needs a fast tokenizer: {e}"
                    ) from e
            return self._tokenizer

    def matcher(self, constraint: Constraint) -> TokenMatcher:
        """A fresh matcher at the start of the output; ConstraintError when llguidance
        cannot compile the constraint (its own message says what it refused)."""
        lib = require_llguidance()
        tokenizer = self._lltokenizer()
        try:
            grammar = constraint.grammar()
        except ValueError as e:
            raise ConstraintError(f"invalid {constraint.kind}: {e}") from e
        try:
            inner = lib.LLMatcher(tokenizer, grammar, log_level=0)
        except (ValueError, RuntimeError) as e:
            raise ConstraintError(f"the {kind_name(constraint)} cannot be enforced: {e}") from e
        if inner.is_error():
            raise ConstraintError(
                f"the {kind_name(constraint)} cannot be enforced: {inner.get_error()}"
            )
        return TokenMatcher(inner, self.vocab_size, self.eos_ids)


def kind_name(constraint: Constraint) -> str:
    return {
        "json_schema": "JSON schema",
        "regex": "regex",
        "lark": "grammar",
        "choice": "choice",
    }[constraint.kind]


class TokenMatcher:
    """One request's position in its grammar: ``mask`` before each step, ``advance``
    with the token chosen. Not thread-safe; it lives on the engine thread."""

    def __init__(self, inner: llguidance.LLMatcher, vocab_size: int, eos_ids: list[int]) -> None:
        self._inner = inner
        self.vocab_size = vocab_size
        self._eos = torch.tensor(eos_ids, dtype=torch.long)

    def words(self) -> np.ndarray:
        """The tokens allowed next as uint32 words [ceil(vocab_size / 32)]: bit i of word j
        is id 32j + i (the monokernel's mask, grammar_mask.py)."""
        n = (self.vocab_size + 31) // 32
        words = np.frombuffer(self._inner.compute_bitmask(), dtype=np.uint32)[:n].copy()
        if self.vocab_size % 32:
            words[-1] &= np.uint32((1 << (self.vocab_size % 32)) - 1)
        if self._inner.is_error() or not words.any():
            # Only after a token the mask forbade (a bug) or a grammar with a dead end:
            # ending the output beats sampling from nothing.
            log.warning("constrained decoding hit a dead end: %s", self._inner.get_error())
            words[:] = 0
            for e in self._eos.tolist():
                words[e >> 5] |= np.uint32(1 << (e & 31))
        return words

    def mask(self) -> torch.Tensor:
        """Boolean [vocab_size] on the CPU: the tokens allowed next."""
        bits = np.unpackbits(self.words().view(np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self.vocab_size].astype(np.bool_))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [V] with every disallowed token at -inf (a new tensor)."""
        allowed = self.mask()
        n = logits.shape[-1]
        if n != allowed.numel():  # logits padded past the tokenizer, or a shorter head
            fit = torch.zeros(n, dtype=torch.bool)
            m = min(n, allowed.numel())
            fit[:m] = allowed[:m]
            allowed = fit
        allowed = allowed.to(logits.device, non_blocking=True)
        return torch.where(allowed, logits, torch.tensor(float("-inf"), device=logits.device))

    def advance(self, token: int) -> None:
        """Feed the chosen token. One outside the mask puts the matcher in its error
        state, after which only EOS is allowed."""
        if not self._inner.consume_token(token):
            log.warning("constrained decoding refused token %d: %s", token, self._inner.get_error())

    @property
    def accepting(self) -> bool:
        return bool(self._inner.is_accepting())


def sample_masked(
    logits: torch.Tensor, params: SamplingParams, position: int, matcher: TokenMatcher | None
) -> int:
    """``sampling.sample`` over the tokens the grammar allows, the matcher advanced with
    the result; plain ``sample`` when ``matcher`` is None."""
    if matcher is None:
        return sample(logits, params, position)
    token = sample(matcher.apply(logits), params, position)
    matcher.advance(token)
    return token
