"""The hf engine on the CPU: our config and weights become an HF model that decodes exactly
like the reference engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from monokernel.bench.hf import HFRunner, build_hf_model, hf_config_dict
from monokernel.models.config import config_from_hf_dict
from monokernel.models.shapes import DENSE_SHAPES, SHAPES
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.backends.reference import ReferenceBackend
from monokernel.runtime.sampling import SamplingParams
from monokernel.testing.tiny_models import TINY_FAMILIES, make_tiny_checkpoint
from monokernel.weights.loader import Checkpoint, load_checkpoint
from monokernel.weights.random_weights import random_weights

CPU = torch.device("cpu")


@pytest.mark.parametrize("shape", sorted(DENSE_SHAPES))
def test_config_round_trips_for_every_dense_catalogue_shape(shape: str) -> None:
    cfg = DENSE_SHAPES[shape]
    assert config_from_hf_dict(hf_config_dict(cfg)) == cfg


def test_configs_hf_cannot_express_are_refused() -> None:
    llama = SHAPES["llama-3.2-1b"]
    with pytest.raises(ValueError, match="together"):
        hf_config_dict(dataclasses.replace(llama, qkv_bias=True))  # o without bias
    with pytest.raises(ValueError, match="qwen2"):
        hf_config_dict(dataclasses.replace(SHAPES["qwen2.5-coder-1.5b"], o_bias=True))


def _reference_ids(ckpt: Checkpoint, prompt: list[int], n: int) -> list[int]:
    ref = ReferenceBackend(ckpt.config, ckpt.weights, 64, CPU)
    req = DecodeRequest(tuple(prompt), SamplingParams(temperature=0.0), n, frozenset())
    return list(ref.stream(req, CancelToken()))


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_hf_generate_matches_the_reference(family: str, tmp_path: Path) -> None:
    ckpt = load_checkpoint(str(make_tiny_checkpoint(family, tmp_path / family)), progress=False)
    assert config_from_hf_dict(hf_config_dict(ckpt.config)) == ckpt.config
    model = build_hf_model(ckpt.config, ckpt.weights, CPU)
    # Our tensors are assigned, not copied: the HF model costs no second set of weights.
    assert model.model.embed_tokens.weight.data_ptr() == ckpt.weights["embed"].data_ptr()
    prompt = [5, 17, 3, 99, 42, 8]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert out[0, len(prompt) :].tolist() == _reference_ids(ckpt, prompt, 12)


def test_hf_matches_the_reference_on_the_odd_shape() -> None:
    cfg = SHAPES["odd"]  # every flag on, head_dim 104, GQA 5:1, untied
    weights = random_weights(cfg, dtype=torch.float32, seed=1, logit_scale=8.0)
    model = build_hf_model(cfg, weights, CPU)
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    prompt = [5, 17, 3, 99, 42, 8]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    ref = ReferenceBackend(cfg, weights, 64, CPU)
    req = DecodeRequest(tuple(prompt), SamplingParams(temperature=0.0), 12, frozenset())
    assert out[0, len(prompt) :].tolist() == list(ref.stream(req, CancelToken()))


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_hf_runner_times_exactly_the_asked_tokens(tiny: Checkpoint, cache: str) -> None:
    runner = HFRunner(tiny.config, tiny.weights, 40, CPU, cache=cache)
    runner.warmup([1, 2, 3, 4], 6)
    timing = runner.run([4, 3, 2, 1], 6)
    assert timing.tokens == 6 and timing.ttft_s > 0 and timing.decode_s_per_token >= 0
    assert runner.info["hf_cache"] in ("static", "dynamic")
    runner.close()
