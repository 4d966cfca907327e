"""The ``torch`` engine: the conventional stack done well (gpt-fast style).

The reference model's math with a static KV cache, one decode step compiled by
``torch.compile(mode="reduce-overhead")`` so that it replays as a CUDA graph; greedy argmax
inside the graph, the next input fed back on the device. Prefill runs on the reference model
straight into the same cache. On the CPU the same step runs eagerly, or with ``cpu_packed``
(what the engine builds there: runtime/backends/__init__.py) on 4- and 8-bit matrices
(cpu_packed.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from monokernel.errors import InvalidRequestError
from monokernel.models.config import ModelConfig
from monokernel.models.rope import apply_rope
from monokernel.models.transformer import KVCache, Transformer, rms_norm
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.backends.cpu_packed import PackedCpuStep
from monokernel.runtime.constrained import sample_masked
from monokernel.runtime.cpu_threads import ThreadGovernor
from monokernel.runtime.logprobs import token_logprobs
from monokernel.runtime.sampling import (
    SamplingParams,
    penalize,
    sample,
    unsupported_sampling_reason,
)
from monokernel.runtime.speculative import Speculating
from monokernel.weights.group_quant import GroupQuant
from monokernel.weights.names import Weights


class _DecodeStep(nn.Module):
    """One token through the model at position ``self.pos``; every tensor is a buffer, so
    CUDA-graph capture sees fixed addresses and the in-place cache writes are allowed."""

    def __init__(self, ref: Transformer, cache: KVCache) -> None:
        super().__init__()
        self.cfg = ref.cfg
        self.names: dict[str, str] = {}
        for name, t in ref.w.items():
            key = name.replace(".", "_")
            self.names[name] = key
            self.register_buffer(key, t, persistent=False)
        self.register_buffer("k_cache", cache.k, persistent=False)  # [L, kvh, max_len, d]
        self.register_buffer("v_cache", cache.v, persistent=False)  # [L, kvh, max_len, d]
        self.register_buffer("cos", ref.cos, persistent=False)  # [max_len, d/2]
        self.register_buffer("sin", ref.sin, persistent=False)  # [max_len, d/2]
        self.register_buffer(  # [1] int64: position of the input token
            "pos", torch.zeros(1, dtype=torch.long, device=cache.k.device), persistent=False
        )
        self.register_buffer(  # [1] int64: the input token; the step leaves its argmax here
            "tok", torch.zeros(1, dtype=torch.long, device=cache.k.device), persistent=False
        )
        self.register_buffer(  # [max_len] int64
            "arange", torch.arange(cache.k.shape[2], device=cache.k.device), persistent=False
        )

    def w(self, name: str) -> torch.Tensor:
        return getattr(self, self.names[name])

    def wopt(self, name: str) -> torch.Tensor | None:
        return getattr(self, self.names[name]) if name in self.names else None

    def _attention(self, x: torch.Tensor, n: int) -> torch.Tensor:
        cfg, p = self.cfg, f"layers.{n}."
        q = F.linear(x, self.w(p + "wq"), self.wopt(p + "bq")).view(1, cfg.num_heads, -1)
        k = F.linear(x, self.w(p + "wk"), self.wopt(p + "bk")).view(1, cfg.num_kv_heads, -1)
        v = F.linear(x, self.w(p + "wv"), self.wopt(p + "bv")).view(1, cfg.num_kv_heads, -1)
        if cfg.qk_norm:
            q = rms_norm(q, self.w(p + "q_norm"), cfg.rms_norm_eps)
            k = rms_norm(k, self.w(p + "k_norm"), cfg.rms_norm_eps)
        cos, sin = self.cos[self.pos], self.sin[self.pos]  # [1, d/2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.k_cache[n].index_copy_(1, self.pos, k.transpose(0, 1))
        self.v_cache[n].index_copy_(1, self.pos, v.transpose(0, 1))
        mask = (self.arange <= self.pos)[None, None, :]  # [1, 1, max_len]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), self.k_cache[n], self.v_cache[n], attn_mask=mask, enable_gqa=True
        )  # [heads, 1, d]
        return F.linear(out.reshape(1, cfg.q_size), self.w(p + "wo"), self.wopt(p + "bo"))

    def forward(self) -> torch.Tensor:
        """Input ``self.tok`` at ``self.pos`` -> logits [V] float32; leaves the greedy next
        token in ``self.tok`` and advances ``pos`` (state stays in buffers, so graph replays
        never hand an overwritten output back in as an input)."""
        cfg = self.cfg
        x = self.w("embed")[self.tok]  # [1, h]
        for n in range(cfg.num_layers):
            p = f"layers.{n}."
            x = x + self._attention(rms_norm(x, self.w(p + "attn_norm"), cfg.rms_norm_eps), n)
            h = rms_norm(x, self.w(p + "ffn_norm"), cfg.rms_norm_eps)
            mlp = F.silu(F.linear(h, self.w(p + "w_gate"))) * F.linear(h, self.w(p + "w_up"))
            x = x + F.linear(mlp, self.w(p + "w_down"))
        head = self.w("embed") if cfg.tie_word_embeddings else self.w("lm_head")
        logits = F.linear(rms_norm(x, self.w("norm"), cfg.rms_norm_eps), head).float()[0]
        self.pos.add_(1)
        self.tok.copy_(torch.argmax(logits).view(1))
        return logits


class TorchBackend(Speculating):
    name = "torch"

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Weights,
        max_seq_len: int,
        device: torch.device,
        compile: bool | None = None,
        cpu_packed: bool = False,
        groups: Mapping[str, GroupQuant] | None = None,
    ) -> None:
        """``cpu_packed``: on the CPU, decode from the layers' matrices packed in 4 or 8 bits
        (cpu_packed.py: close to the float32 step, not bitwise); off, the float32 step that
        matches the reference exactly (the tests compare the engines with it). ``groups``:
        a 4-bit checkpoint's own groups, which the packed step takes as they are."""
        self.cfg, self.device, self.max_seq_len = cfg, torch.device(device), max_seq_len
        self.ref = Transformer(cfg, weights, max_seq_len)
        self.cache = self.ref.new_cache(max_seq_len)
        self.packed: PackedCpuStep | None = None
        self.module: _DecodeStep | PackedCpuStep
        if cpu_packed and self.device.type == "cpu":
            self.module = self.packed = PackedCpuStep(self.ref, self.cache, groups)
        else:
            self.module = _DecodeStep(self.ref, self.cache)
        use_compile = self.device.type == "cuda" if compile is None else compile
        self.compiled = use_compile and self.packed is None
        self._step = (
            torch.compile(self.module, mode="reduce-overhead", fullgraph=True)
            if self.compiled
            else self.module
        )
        # On the CPU, as many threads as cores no other process is busy on (cpu_threads.py).
        self._threads = ThreadGovernor() if self.device.type == "cpu" else None

    # -- speculative decoding (runtime/speculative.py) -------------------------------------

    def _forward(self, tokens: list[int], start: int) -> torch.Tensor:
        if self._threads is not None:
            self._threads.token()  # a pass: the governor's unit, as a step is
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        if self.packed is not None:
            # Drafts verified with the decode step's own arithmetic (cpu_packed.py).
            return self.packed.forward_tokens(ids, start)
        # Eager: a captured step has one token's shapes. Its bf16 sums on a GPU are not the
        # compiled step's, so no draft is made there (drafts_verified) and this runs where
        # the step is this same float32 forward.
        return self.ref.forward(ids, start, self.cache)

    def _greedy_pass(self, tokens: list[int], start: int) -> list[int] | None:
        if self.packed is None:
            return None  # the logits' argmax, as the float32 and compiled steps pick
        if self._threads is not None:
            self._threads.token()
        # The 4-bit head's candidates, as a plain greedy step picks, rather than the int8
        # logits a sampled pass needs: half the head's bytes, and the very pick (cpu_packed.py).
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return self.packed.greedy_tokens(ids, start).tolist()

    def drafts_by_default(self) -> bool:
        # The packed CPU step's passes: spec-chat 1.18x, spec-tool 1.34x, spec-edit 1.48x at
        # K = 3 on the default model (2-core CPU, session 51; docs/speculative.md).
        return self.packed is not None

    def drafts_verified(self) -> bool:
        # On a GPU a pass of several positions runs eagerly, in bf16 sums that are not the
        # compiled one-token step's: at a near-tie it picks another token (docs/
        # speculative.md measured it on an H100), so there the drafts are not made.
        return self.device.type != "cuda"

    def _plain_step(self, token: int, pos: int, params: SamplingParams) -> int:
        """A pass without a draft: ``stream``'s own step (the compiled one on a GPU, the
        packed 4-bit-head pick on the CPU) rather than a one-position verification pass."""
        self.module.tok.fill_(token)
        self.module.pos.fill_(pos)
        # Speculation refuses grammars, penalties and logprobs: greedy is on_device here.
        logits = self._advance(params.greedy)
        if params.greedy:
            return int(self.module.tok)
        assert logits is not None
        return sample(logits, params, pos + 1)

    # -- one token a pass --------------------------------------------------------------------

    def _call(self) -> torch.Tensor:
        if self.compiled:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.inference_mode():
            return self._step()

    def _advance(self, on_device: bool) -> torch.Tensor | None:
        """One decode step of the step module's ``tok`` at its ``pos``: leaves the greedy next
        token in ``tok``, advances ``pos`` and returns the logits; None where ``on_device``
        (the host reads only ``tok``) lets the packed step skip them."""
        if self._threads is not None:
            self._threads.token()
        if on_device and self.packed is not None:
            # The token is all this request reads: the packed step picks it from a
            # cheaper 4-bit head, scored in float32 (cpu_packed.py).
            self.packed.greedy()
            return None
        return self._call()

    def stream(self, request: DecodeRequest, cancel: CancelToken) -> Iterator[int]:
        ids, sp = request.prompt_ids, request.sampling
        n = len(ids)
        if n == 0 or n > self.max_seq_len:
            raise InvalidRequestError(f"prompt length {n} must be in [1, {self.max_seq_len}]")
        reason = unsupported_sampling_reason(sp, self.name)
        if reason is not None:
            raise InvalidRequestError(reason)
        if self._threads is not None:
            self._threads.request_started()
        prompt = torch.tensor(ids, dtype=torch.long, device=self.device)
        logits = self.ref.prefill(prompt, self.cache)
        if self.drafting(request):
            yield from self._speculate(logits, request, cancel, self.max_seq_len)
            return
        tok = self.module.tok  # [1] int64 buffer, the step's input and greedy output
        # The step's in-graph argmax ignores the grammar and the penalties: such a request
        # draws on the host from the processed logits, as sampling does.
        want_logprobs = request.logprobs is not None and sp.logprobs is not None
        on_device = sp.greedy and request.matcher is None and not sp.penalized
        on_device = on_device and not want_logprobs  # they need the logits on the host
        if on_device:
            tok.copy_(torch.argmax(logits).view(1))
        self.module.pos.fill_(n)
        pos = n  # where the token being sampled will sit
        output: list[int] = []  # the tokens so far, for the penalties
        for produced in range(1, request.max_new_tokens + 1):
            if cancel.is_set():
                return
            if on_device:
                token = int(tok)  # the one sync per token: the host needs the id
            else:
                raw = logits
                if sp.penalized:
                    logits = penalize(logits, sp, ids, output)
                token = sample_masked(logits, sp, pos, request.matcher)
                tok.fill_(token)
                output.append(token)
                if want_logprobs:
                    assert request.logprobs is not None and sp.logprobs is not None
                    request.logprobs.append(token_logprobs(raw, token, sp.logprobs))
            yield token
            if token in request.stop_token_ids or produced == request.max_new_tokens:
                return
            if pos >= self.max_seq_len:
                return  # the cache is full
            step_logits = self._advance(on_device)
            if step_logits is not None:
                logits = step_logits
            pos += 1

    def close(self) -> None:
        del self._step, self.module, self.packed, self.cache, self.ref
