"""Sampling parameters and the reference sampler.

The sampler is a pure function of (logits, params, position): no hidden RNG state. Random
draws come from a counter-based hash keyed by (seed, absolute position, token id), so the
same request gives the same tokens on any backend, and a GPU kernel can reproduce the exact
draws of this file. The rule, which every backend implements identically:

1. temperature == 0: greedy, argmax with ties to the lowest token id.
2. z = logits / temperature (float32).
3. top_k > 0: keep tokens with z >= the k-th largest z (ties at the boundary kept).
4. top_p < 1: p = softmax(z over kept); keep tokens with p >= p*, where p* is the
   probability at which the descending cumulative sum first reaches top_p (ties kept).
5. Gumbel-max: the kept token maximising z + g, g = -log(-log(u)), u = uniform(seed, pos, id)
   (ties to the lowest token id). This draws exactly from softmax(z) over the kept set.

``min_p`` > 0 adds a step between 2 and 3: keep tokens whose softmax(z) probability is at
least min_p times the largest (greedy is unchanged by it). Before the rule, ``penalize``
turns the raw logits into the ones sampled from (OpenAI's ``logit_bias``,
``presence_penalty``, ``frequency_penalty`` and vLLM's ``repetition_penalty``); the
monokernel applies the same rule inside its loop (kernels/csrc/sampling.cuh).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from monokernel.errors import InvalidRequestError

if TYPE_CHECKING:
    from monokernel.runtime.constrained import Constraint

_M32 = 0xFFFFFFFF


MAX_LOGPROBS = 20  # alternatives a token (OpenAI's top_logprobs bound; vLLM's default)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None  # None: a fresh random seed per request
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    extra: dict[str, object] = field(default_factory=dict, compare=False)
    # What the output must match (runtime/constrained.py). Here rather than on the
    # DecodeRequest because it is part of what the caller asks of the sampling rule, like
    # top_p; the per-request matcher the Engine builds from it rides on the DecodeRequest.
    constraint: Constraint | None = None
    # Logit processing (``penalize``): OpenAI's penalties on the output so far, vLLM's
    # repetition_penalty on prompt + output, min_p, and logit_bias as (token id, bias)
    # pairs sorted by id (a mapping is accepted and converted).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Each generated token's log-probability and the ``logprobs`` most likely alternatives'
    # (runtime/logprobs.py); None: off, 0: the chosen token's alone, at most MAX_LOGPROBS.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
            )
        if not self.temperature >= 0:  # also rejects NaN
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be an integer >= 0 (0 or -1 turn it off), got {self.top_k!r}"
            )
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequestError(f"seed must be a non-negative integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be a list of non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2 <= v <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not _is_real(rp) or not 0 < rp < float("inf"):
            raise InvalidRequestError(f"repetition_penalty must be > 0, got {rp!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise InvalidRequestError("logit_bias must map token ids to biases")
            token, bias = pair
            if type(token) is not int or token < 0:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids (integers >= 0), got {token!r}"
                )
            if not _is_real(bias) or not -100 <= bias <= 100:
                raise InvalidRequestError(
                    f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}"
                )
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidRequestError("logit_bias names a token id more than once")
        n = self.logprobs
        if n is not None and (type(n) is not int or not 0 <= n <= MAX_LOGPROBS):
            raise InvalidRequestError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (alternatives a token), "
                f"got {n!r}"
            )

    def host_fields(self) -> list[str]:
        """What only an engine sampling on the host does: the logit processing set, then
        ``logprobs`` when asked for."""
        return self.penalty_fields() + (["logprobs"] if self.logprobs is not None else [])

    def penalty_fields(self) -> list[str]:
        """The logit-processing fields set to other than their neutral value."""
        neutral = {
            "presence_penalty": self.presence_penalty == 0,
            "frequency_penalty": self.frequency_penalty == 0,
            "repetition_penalty": self.repetition_penalty == 1,
            "min_p": self.min_p == 0,
            "logit_bias": not self.logit_bias,
        }
        return [name for name, is_neutral in neutral.items() if not is_neutral]

    @property
    def penalized(self) -> bool:
        """Whether ``penalize`` changes the logits (or min_p the kept set)."""
        return bool(self.penalty_fields())

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_seed(self) -> SamplingParams:
        """A copy whose seed is fixed (drawn now if it was None)."""
        if self.seed is not None:
            return self
        return _replace(self, seed=secrets.randbits(63))


def _is_real(v: object) -> bool:
    return type(v) in (int, float)


# Engines that apply the logit processing and compute logprobs: the host-sampling ones from
# the logits they hold, the monokernel inside its loop (kernels/csrc/sampling.cuh).
PENALTY_ENGINES = ("reference", "torch", "monokernel")


def unsupported_sampling_reason(params: SamplingParams, engine: str) -> str | None:
    """Why an engine cannot honour ``params``' logit processing or logprobs, or None when
    it can. The message starts with the first such field's name. (Under --speculative such
    a request decodes without drafts: Speculating.drafting.)"""
    fields = params.host_fields()
    if not fields:
        return None
    name = fields[0]
    if engine not in PENALTY_ENGINES:
        return (
            f"{name} is supported by the {', '.join(PENALTY_ENGINES)} engines; this server "
            f"runs the {engine} engine"
        )
    return None


def _replace(p: SamplingParams, **changes: object) -> SamplingParams:
    from dataclasses import replace

    return replace(p, **changes)


# ---- counter-based RNG (uint32 arithmetic held in int64 tensors) ---------------------------


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on uint32 values stored in int64."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def _fmix32_int(x: int) -> int:
    return int(fmix32(torch.tensor(x & _M32, dtype=torch.int64)))


def draw_key(seed: int, position: int) -> int:
    """The 32-bit key of one draw: hash(seed_lo, hash(seed_hi, hash(position)))."""
    lo, hi = seed & _M32, (seed >> 32) & _M32
    k = _fmix32_int((position + 0x9E3779B9) & _M32)
    k = _fmix32_int(hi ^ k)
    return _fmix32_int(lo ^ k)


def uniforms(
    seed: int, position: int, vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """u in (0, 1), float32 [vocab_size]:
    u_i = ((fmix32(key ^ (i * 0x9E3779B1)) >> 8) + 0.5) / 2^24."""
    key = draw_key(seed, position)
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
    bits = fmix32(key ^ ((ids * 0x9E3779B1) & _M32))
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def gumbel(
    seed: int, position: int, vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    return -torch.log(-torch.log(uniforms(seed, position, vocab_size, device)))


# ---- the rule ---------------------------------------------------------------------------------


def allowed_mask(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Boolean [V]: tokens that survive top-k then top-p (steps 3 and 4 of the rule)."""
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k > 0 and top_k < z.numel():
        kth = torch.topk(z, top_k).values[-1]
        keep = z >= kth
    if top_p < 1.0:
        probs = torch.softmax(torch.where(keep, z, float("-inf")), dim=-1)
        sorted_p = torch.sort(probs, descending=True).values
        cum = torch.cumsum(sorted_p, dim=-1)
        cut = int(torch.searchsorted(cum, torch.tensor(top_p, dtype=cum.dtype, device=cum.device)))
        cut = min(cut, sorted_p.numel() - 1)
        keep = keep & (probs >= sorted_p[cut])
    return keep


def min_p_mask(z: torch.Tensor, min_p: float) -> torch.Tensor:
    """Boolean [V]: tokens whose softmax(z) probability is >= min_p * the largest."""
    if min_p <= 0:
        return torch.ones_like(z, dtype=torch.bool)
    probs = torch.softmax(z, dim=-1)
    return probs >= min_p * probs.max()


def _kept(z: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    if params.min_p <= 0:
        return allowed_mask(z, params.top_k, params.top_p)
    first = min_p_mask(z, params.min_p)
    return first & allowed_mask(torch.where(first, z, float("-inf")), params.top_k, params.top_p)


def check_bias_ids(params: SamplingParams, vocab_size: int) -> None:
    """Refuse a logit_bias that names an id past the vocabulary (its pairs are sorted by id)."""
    if params.logit_bias and params.logit_bias[-1][0] >= vocab_size:
        raise InvalidRequestError(
            f"logit_bias names token {params.logit_bias[-1][0]}, past the vocabulary of "
            f"{vocab_size}"
        )


def penalize(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int] | torch.Tensor,
    output_ids: Sequence[int] | torch.Tensor,
) -> torch.Tensor:
    """The logits the sampling rule draws from, float32 [V] (a new tensor when changed):

    1. logit_bias: z[t] += bias[t].
    2. repetition_penalty r (vLLM/HF): for t in prompt or output, z[t] / r if z[t] > 0,
       else z[t] * r.
    3. frequency_penalty f and presence_penalty p (OpenAI/vLLM, on the output only):
       z[t] -= f * count(t in output) + p * (count > 0).

    -inf logits (a grammar's mask) stay -inf. min_p is part of ``sample``, as it depends
    on the temperature."""
    z = logits.float()
    counting = params.frequency_penalty != 0 or params.presence_penalty != 0
    if not (params.logit_bias or params.repetition_penalty != 1 or counting):
        return z
    z = z.clone()
    v, dev = z.numel(), z.device
    if params.logit_bias:
        check_bias_ids(params, v)
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
        z.index_add_(0, ids.to(dev), bias.to(dev))
    out = torch.as_tensor(output_ids, dtype=torch.long).to(dev)
    if params.repetition_penalty != 1:
        seen = torch.zeros(v, dtype=torch.bool, device=dev)
        seen[torch.as_tensor(prompt_ids, dtype=torch.long).to(dev)] = True
        seen[out] = True
        r = params.repetition_penalty
        z = torch.where(seen, torch.where(z > 0, z / r, z * r), z)
    if counting:
        counts = torch.bincount(out, minlength=v)[:v].float()
        z = z - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    return z


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """One token from logits [V] (any float dtype) at absolute position ``position``."""
    z = logits.float()
    if params.greedy:
        return int(torch.argmax(z))
    if params.seed is None:
        raise InvalidRequestError("sample() needs a fixed seed; call params.with_seed() first")
    z = z / params.temperature
    keep = _kept(z, params)
    scores = torch.where(
        keep, z + gumbel(params.seed, position, z.numel(), z.device), float("-inf")
    )
    return int(torch.argmax(scores))


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution ``sample`` draws from: softmax(z) restricted to the kept set."""
    z = logits.float() / max(params.temperature, 1e-30)
    keep = _kept(z, params)
    return torch.softmax(torch.where(keep, z, float("-inf")), dim=-1)
