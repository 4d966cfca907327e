"""The reference forward against HF transformers on tiny random checkpoints of every family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from monokernel.models.config import load_hf_config
from monokernel.models.transformer import Transformer
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.backends.reference import ReferenceBackend
from monokernel.runtime.sampling import SamplingParams
from monokernel.testing.tiny_models import TINY_FAMILIES, make_tiny_checkpoint
from monokernel.weights.safetensors_loader import load_safetensors_weights

FAMILIES = sorted(TINY_FAMILIES)


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def _hf_model(path: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _ours(path: Path, max_len: int = 128) -> Transformer:
    cfg = load_hf_config(path)
    return Transformer(cfg, load_safetensors_weights(path, cfg), max_len)


def test_prefill_and_decode_logits_match_hf(checkpoint: Path) -> None:
    hf, ours = _hf_model(checkpoint), _ours(checkpoint)
    tokens = torch.randint(3, 131, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]
    # Prefill 30 tokens, then decode the remaining 7 one at a time through the cache.
    cache = ours.new_cache(128)
    got = [ours.forward(tokens[:30], 0, cache)]
    got += [ours.forward(tokens[i : i + 1], i, cache) for i in range(30, 37)]
    logits = torch.cat(got)
    rel = (logits - expected).abs().max() / expected.abs().max()
    assert rel <= 1e-4, f"max relative error {rel:.2e}"


def test_greedy_continuation_matches_hf(checkpoint: Path) -> None:
    hf, ours = _hf_model(checkpoint), _ours(checkpoint)
    prompt = [1, 17, 42, 99, 5, 63, 8]
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    expected = out[0, len(prompt) :].tolist()
    backend = ReferenceBackend(ours.cfg, ours.w, 128, torch.device("cpu"))
    request = DecodeRequest(tuple(prompt), SamplingParams(temperature=0.0), 32, frozenset())
    assert list(backend.stream(request, CancelToken())) == expected


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_one_forward(chunk: int) -> None:
    """Transformer.prefill in chunks: the last logits and every cached K/V of one forward."""
    from monokernel.models.shapes import SHAPES
    from monokernel.weights.random_weights import random_weights

    cfg = SHAPES["odd"]
    model = Transformer(cfg, random_weights(cfg, seed=3, dtype=torch.float32), 64)
    tokens = torch.randint(0, cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(4))
    whole, chunked = model.new_cache(64), model.new_cache(64)
    want = model.forward(tokens, 0, whole, last_only=True)[0]
    got = model.prefill(tokens, chunked, chunk=chunk)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked.k[:, :, :50], whole.k[:, :, :50], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked.v[:, :, :50], whole.v[:, :, :50], rtol=1e-5, atol=1e-5)
