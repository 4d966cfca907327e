"""The ``hf`` engine: transformers' ``model.generate`` on our weights, as most people run it.

The HF model is built from our ModelConfig (the inverse of ``config_from_hf_dict``) and our
weight tensors are assigned into it without a copy (``weights/names.py`` holds the name
table). Timing follows what a user of ``generate`` can see: TTFT is a whole
``generate(max_new_tokens=1)`` call; the decode rate is the rest of a longer call,
``(t(N) - t(1)) / (N - 1)``, so it includes generate's own per-step overhead.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from monokernel.bench.measure import RunTiming
from monokernel.models.config import ModelConfig, hf_core_fields
from monokernel.weights.names import Weights, ours_to_hf

_HF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """An HF ``config.json`` dict that ``config_from_hf_dict`` maps back onto ``cfg``.

    Raises ValueError for a ModelConfig HF cannot express: HF's ``attention_bias`` puts a
    bias on q, k, v *and* o together (llama, qwen3), qwen2 always biases q/k/v and never o,
    and mistral has no biases."""
    fam = cfg.family
    if fam not in _HF_FAMILIES:
        raise ValueError(f"no transformers class for family {fam!r}")
    if fam == "qwen2" and (not cfg.qkv_bias or cfg.o_bias):
        raise ValueError("qwen2 in transformers has q/k/v biases and no o bias")
    if fam == "mistral" and (cfg.qkv_bias or cfg.o_bias):
        raise ValueError("mistral in transformers has no attention biases")
    if fam in ("llama", "qwen3") and cfg.qkv_bias != cfg.o_bias:
        raise ValueError(f"{fam} in transformers biases q, k, v and o together or not at all")
    if cfg.qk_norm != (fam == "qwen3"):
        raise ValueError("q/k RMSNorm exists exactly for qwen3 in transformers")
    d = hf_core_fields(cfg) | {"eos_token_id": list(cfg.eos_token_ids) or None}
    if fam in ("llama", "qwen3"):
        d["attention_bias"] = cfg.qkv_bias
    if fam in ("mistral", "qwen2", "qwen3"):
        d["sliding_window"] = None  # full attention, as ModelConfig requires
        d["use_sliding_window"] = False
    return d


def build_hf_model(cfg: ModelConfig, weights: Weights, device: torch.device) -> Any:
    """An HF CausalLM on ``device`` in the weights' dtype, sharing the weight tensors."""
    import transformers

    d = hf_config_dict(cfg)
    config = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    dtype = weights["embed"].dtype
    # Build in the target dtype on the target device: the random init this runs first is
    # then one fast device fill instead of gigabytes of fp32 on the host.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation="sdpa"
            )
    finally:
        torch.set_default_dtype(previous)
    state = {ours_to_hf(name): t.to(device) for name, t in weights.items()}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # one tensor, read twice
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"HF model mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.eval()
    gen = model.generation_config
    # Generate exactly the asked-for tokens, greedily, like every other engine here.
    gen.eos_token_id = None
    gen.bos_token_id = None
    gen.pad_token_id = 0
    gen.do_sample = False
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HFRunner:
    name = "hf"

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Weights,
        max_len: int,
        device: torch.device,
        cache: str = "static",
    ) -> None:
        if cache not in ("static", "dynamic"):
            raise ValueError(f"hf cache must be static or dynamic, got {cache!r}")
        self.model = build_hf_model(cfg, weights, device)
        self.device = device
        self.cache = cache
        self.info: dict[str, Any] = {"hf_cache": cache}

    def _generate(self, ids: torch.Tensor, n: int) -> int:
        kwargs: dict[str, Any] = {
            "max_new_tokens": n,
            "do_sample": False,
            "attention_mask": torch.ones_like(ids),
        }
        if self.cache == "static":
            # On CUDA, generate compiles the decode step for a static cache by itself.
            kwargs["cache_implementation"] = "static"
        with torch.inference_mode():
            out = self.model.generate(ids, **kwargs)
        return int(out.shape[1] - ids.shape[1])

    def _timed(self, ids: torch.Tensor, n: int) -> tuple[float, int]:
        _sync(self.device)
        t0 = time.perf_counter()
        try:
            produced = self._generate(ids, n)
        except Exception as e:
            if self.cache != "static":
                raise
            # The static cache is the fast path but not supported everywhere: fall back to
            # generate's default, and say so in the record.
            self.cache = "dynamic"
            self.info = {"hf_cache": "dynamic", "hf_static_error": f"{type(e).__name__}: {e}"}
            _sync(self.device)
            t0 = time.perf_counter()
            produced = self._generate(ids, n)
        _sync(self.device)
        return time.perf_counter() - t0, produced

    def warmup(self, prompt: list[int], gen_tokens: int, longer_by: int = 0) -> None:
        """Static cache: generate the full length once, so the cache is sized and the decode
        step compiled for the timed calls (a shorter warm-up would leave a recompile in
        the first timed request). ``longer_by``: the timed prompts are that many tokens
        longer than ``prompt`` (a turn cell); generating that many more sizes the cache for
        them while the warm-up still runs the base prompt."""
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        static = gen_tokens + longer_by
        self._timed(ids, static if self.cache == "static" else min(gen_tokens, 32))

    def run(self, prompt: list[int], gen_tokens: int) -> RunTiming:
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        total, produced = self._timed(ids, gen_tokens)
        ttft, _ = self._timed(ids, 1)
        if produced != gen_tokens:
            raise RuntimeError(f"generate produced {produced} tokens, asked for {gen_tokens}")
        per_token = max(total - ttft, 0.0) / max(gen_tokens - 1, 1)
        return RunTiming(ttft, per_token, produced)

    def close(self) -> None:
        del self.model
