"""Each generated token's log-probability (runtime/logprobs.py) against a recomputation:
the reference forward over prompt + output, log_softmax at each step, on the reference and
torch engines, greedy and sampled; and the top-N rule's ties."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from monokernel.errors import InvalidRequestError
from monokernel.models.transformer import Transformer
from monokernel.runtime.engine import Engine, EngineConfig
from monokernel.runtime.logprobs import token_logprobs
from monokernel.runtime.sampling import MAX_LOGPROBS, SamplingParams
from monokernel.testing.tiny_models import make_tiny_model_dir
from monokernel.weights.loader import load_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir("qwen2", tmp_path_factory.mktemp("logprobs") / "m")


@pytest.mark.parametrize("engine_name", ["reference", "torch"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_are_the_models_log_softmax(
    model_dir: Path, engine_name: str, temperature: float
) -> None:
    engine = Engine(model_dir, EngineConfig(engine=engine_name, device="cpu", progress=False))
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=3, logprobs=4)
    events = [e for e in engine.generate("def f(x):", params) if e.token_id is not None]
    assert len(events) == 12 and all(e.logprobs is not None for e in events)
    ckpt = load_checkpoint(model_dir, progress=False)
    prompt = engine.encode("def f(x):")
    seq = torch.tensor(prompt + [e.token_id for e in events])
    ref = Transformer(ckpt.config, {k: v.float() for k, v in ckpt.weights.items()}, len(seq))
    logits = ref.forward(seq, 0, ref.new_cache(len(seq)))  # [T, V]
    want = torch.log_softmax(logits[len(prompt) - 1 : -1].double(), dim=-1)
    # The torch engine on the CPU runs 8-bit matrices (cpu_packed.py): its own model's
    # figures, near the float32 one's.
    tol = 2e-4 if engine_name == "reference" else 0.1
    for step, e in enumerate(events):
        assert e.logprobs is not None
        assert e.logprobs.logprob == pytest.approx(float(want[step, e.token_id]), abs=tol)
        top_ids = [i for i, _ in e.logprobs.top]
        if engine_name == "reference":
            assert top_ids == torch.topk(want[step], 4).indices.tolist()
        if temperature == 0:
            assert top_ids[0] == e.token_id


def test_top_n_and_ties() -> None:
    logits = torch.tensor([0.0, 2.0, 2.0, -1.0, 1.0])
    lp = token_logprobs(logits, 3, 3)
    assert [i for i, _ in lp.top] == [1, 2, 4]  # the tie to the lower id
    assert lp.logprob == pytest.approx(float(torch.log_softmax(logits, 0)[3]))
    assert token_logprobs(logits, 0, 0).top == ()
    assert len(token_logprobs(logits, 0, MAX_LOGPROBS).top) == 5  # at most the vocabulary


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, 1.5, True])
def test_bad_counts_are_refused(bad: object) -> None:
    with pytest.raises(InvalidRequestError, match="logprobs must be an integer"):
        SamplingParams(logprobs=bad)  # type: ignore[arg-type]
