"""Engine: tokenize -> prefill -> decode on a backend -> stream text events.

The one API everything else (CLI, server, benchmarks) wraps::

    engine = Engine(model=None, config=EngineConfig())  # None: the default model
    for event in engine.generate("def reverse(s):", SamplingParams(max_tokens=64)):
        print(event.text, end="")
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from monokernel.errors import InvalidRequestError
from monokernel.models.config import ModelConfig
from monokernel.runtime.backends import create_backend, resolve_engine
from monokernel.runtime.backends.base import Backend, CancelToken, DecodeRequest
from monokernel.runtime.sampling import SamplingParams
from monokernel.tokenizer.detokenize import IncrementalDetokenizer
from monokernel.tokenizer.stop_strings import StopStringMatcher
from monokernel.tokenizer.tokenizer import Prompt, Tokenizer
from monokernel.weights.loader import Checkpoint, load_checkpoint
from monokernel.weights.safetensors_loader import cast_weights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(frozen=True, slots=True)
class EngineConfig:
    engine: str = "auto"  # auto | reference | torch | monokernel
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16
    max_model_len: int | None = None  # default: min(model's maximum, 8192)
    progress: bool = True  # download progress bars on stderr
    tp: int = 1  # tensor-parallel GPUs (monokernel only): cuda:0..tp-1, or from --device cuda:N
    # Reuse the KV cache of earlier requests' common prefix (backends that can: monokernel).
    # None: the backend's default (on; MONOKERNEL_PREFIX_REUSE=0 turns it off).
    prefix_reuse: bool | None = None


@dataclass(frozen=True, slots=True)
class Timings:
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float  # request start -> first generated token
    decode_s: float  # first generated token -> last

    @property
    def prompt_tok_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One per generated token, then one final event (token_id None) with finish_reason."""

    token_id: int | None
    text: str  # text delta that became safe to emit with this event
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" on the final event
    timings: Timings | None = None  # on the final event


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    timings: Timings
    prompt_ids: list[int] = field(default_factory=list)


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("--device cuda was asked for but no CUDA GPU is visible")
    if device.type not in ("cpu", "cuda"):
        raise InvalidRequestError(f"device {name!r} is not supported; use auto, cpu or cuda")
    return device


def _pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise InvalidRequestError(f"dtype {name!r} is not supported; use auto, float32, bfloat16")
    return _DTYPES[name]


class Engine:
    """A loaded model on one device with one backend. Serves one request at a time."""

    def __init__(
        self,
        model: str | Path | Checkpoint | None = None,
        config: EngineConfig | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.device = _pick_device(self.config.device)
        self.dtype = _pick_dtype(self.config.dtype, self.device)
        self.engine_name = resolve_engine(self.config.engine, self.device)
        ckpt = (
            model
            if isinstance(model, Checkpoint)
            else load_checkpoint(model, progress=self.config.progress)
        )
        self.model_config: ModelConfig = ckpt.config
        self.source = ckpt.source
        self.eos_token_ids = frozenset(ckpt.eos_token_ids)
        self.tokenizer = Tokenizer.load(ckpt.tokenizer_dir, ckpt.gguf_file)
        limit = ckpt.config.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len or DEFAULT_MAX_MODEL_LEN, limit)
        weights = cast_weights(dict(ckpt.weights), self.dtype, self.device)
        self.backend: Backend = create_backend(
            self.engine_name, ckpt.config, weights, self.max_model_len, self.device, self.config.tp
        )
        set_reuse = getattr(self.backend, "set_prefix_reuse", None)
        if self.config.prefix_reuse is not None and callable(set_reuse):
            set_reuse(self.config.prefix_reuse)
        self._busy = threading.Lock()

    # -- requests ------------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str) and not prompt:
            raise InvalidRequestError("the prompt is empty")
        ids = self.tokenizer.encode_prompt(prompt)
        if not ids:
            raise InvalidRequestError("the prompt encodes to no tokens")
        return ids

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) is "
                f"{prompt_len + max_tokens} tokens, over the context limit of "
                f"{self.max_model_len}; shorten the prompt or lower max_tokens"
            )

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        cancel: CancelToken | None = None,
        prompt_ids: list[int] | None = None,
    ) -> Iterator[TokenEvent]:
        """Stream a completion. ``prompt_ids`` skips tokenisation when the caller already
        has them. Setting ``cancel`` (from any thread) ends the stream within a token."""
        params = (params or SamplingParams()).with_seed()
        ids = prompt_ids if prompt_ids is not None else self.encode(prompt)
        self.check_fits(len(ids), params.max_tokens)
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_token_ids
        )
        request = DecodeRequest(tuple(ids), params, params.max_tokens, stop_ids)
        return self._run(request, cancel or CancelToken())

    def _run(self, request: DecodeRequest, cancel: CancelToken) -> Iterator[TokenEvent]:
        with self._busy:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_ids)
            stops = StopStringMatcher(request.sampling.stop)
            start = time.perf_counter()
            first = last = start
            count = 0
            finish = "cancelled"
            tokens = self.backend.stream(request, cancel)
            try:
                for token in tokens:
                    last = time.perf_counter()
                    if count == 0:
                        first = last
                    count += 1
                    text = stops.feed(detok.add(token))
                    if stops.stopped:
                        cancel.set()
                        finish = "stop"
                        yield TokenEvent(token, text)
                        break
                    yield TokenEvent(token, text)
                    if token in request.stop_token_ids:
                        finish = "stop"
                        break
                    if count == request.max_new_tokens:
                        finish = "length"
                        break
            finally:
                tokens.close()  # lets the backend stop its device loop and tidy up
            tail = ""
            if not stops.stopped:
                tail = stops.feed(detok.flush())
                if stops.stopped:  # the held-back tail completed a stop string
                    finish = "stop"
                else:
                    tail += stops.flush()
            timings = Timings(len(request.prompt_ids), count, first - start, last - first)
            yield TokenEvent(None, tail, finish, timings)

    def complete(self, prompt: Prompt, params: SamplingParams | None = None) -> Completion:
        """Run a whole request; the non-streaming form of ``generate``."""
        ids = self.encode(prompt)
        parts: list[str] = []
        token_ids: list[int] = []
        final: TokenEvent | None = None
        for event in self.generate(prompt, params, prompt_ids=ids):
            parts.append(event.text)
            if event.token_id is None:
                final = event
            else:
                token_ids.append(event.token_id)
        assert final is not None and final.finish_reason and final.timings
        return Completion("".join(parts), token_ids, final.finish_reason, final.timings, ids)

    def close(self) -> None:
        self.backend.close()
