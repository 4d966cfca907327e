"""The packed step's layers (cpu_layers.py) scripted against the same module run eagerly."""

from __future__ import annotations

import pytest
import torch

from monokernel.models.transformer import Transformer
from monokernel.runtime.backends import cpu_packed
from monokernel.runtime.backends.cpu_layers import PackedLayers
from monokernel.runtime.backends.cpu_packed import PackedCpuStep
from monokernel.runtime.backends.test_cpu_packed import SMALL, _prompt, _weights


def test_the_layers_are_scripted() -> None:
    """Where TorchScript compiles the module (this torch): a fallback to eager would cost
    ~2 ms a token on the default model and pass every other test."""
    cfg = SMALL["int4"]
    model = Transformer(cfg, _weights("int4", 1), 16)
    step = PackedCpuStep(model, model.new_cache(16))
    assert isinstance(step.run_layers, torch.jit.ScriptModule)


@pytest.mark.parametrize("name", list(SMALL))
def test_scripted_equals_eager_bitwise(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every family's branches (biases, Q/K norms, int4, int8 and float32 matrices): logits
    and cache the same to the bit, for a forward of several tokens and single steps."""
    cfg = SMALL[name]
    model = Transformer(cfg, _weights(name, 4), 32)
    tokens = _prompt(cfg, 10)
    runs = []
    for scripted in (True, False):
        with monkeypatch.context() as m:
            if not scripted:
                m.setattr(cpu_packed, "script", lambda layers: layers)
            cache = model.new_cache(32)
            step = PackedCpuStep(model, cache)
        assert isinstance(step.run_layers, PackedLayers) != scripted
        logits = [step.forward_tokens(tokens[:6], 0)]
        logits += [step.forward_tokens(tokens[p : p + 1], p) for p in range(6, 10)]
        runs.append((torch.cat(logits), cache.k.clone(), cache.v.clone()))
    for got, want in zip(*runs, strict=True):
        assert torch.equal(got, want)
