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
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from monokernel.errors import InvalidRequestError

if TYPE_CHECKING:
    from monokernel.runtime.constrained import Constraint

_M32 = 0xFFFFFFFF


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_seed(self) -> SamplingParams:
        """A copy whose seed is fixed (drawn now if it was None)."""
        if self.seed is not None:
            return self
        return _replace(self, seed=secrets.randbits(63))


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


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """One token from logits [V] (any float dtype) at absolute position ``position``."""
    z = logits.float()
    if params.greedy:
        return int(torch.argmax(z))
    if params.seed is None:
        raise InvalidRequestError("sample() needs a fixed seed; call params.with_seed() first")
    z = z / params.temperature
    keep = allowed_mask(z, params.top_k, params.top_p)
    scores = torch.where(
        keep, z + gumbel(params.seed, position, z.numel(), z.device), float("-inf")
    )
    return int(torch.argmax(scores))


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution ``sample`` draws from: softmax(z) restricted to the kept set."""
    z = logits.float() / max(params.temperature, 1e-30)
    keep = allowed_mask(z, params.top_k, params.top_p)
    return torch.softmax(torch.where(keep, z, float("-inf")), dim=-1)
