"""The monokernel backend's load from a GGUF's own groups, on the CPU: up to the KV cache.

The backend's checks, its bf16 copy of the weights and its repack run as they do on a GPU
(the kernel build, the device's free memory and the cache are stood in for), so a change
that made a layer matrix dense on that path (the 130 GB float32 copy of a 32B Q4_K_M)
fails here, where the GPU tests cannot run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from monokernel.runtime import kv_memory
from monokernel.testing.backend_on_cpu import repacked_on_cpu, stop_at_the_cache
from monokernel.testing.counted import count_dense
from monokernel.weights.lazy_weights import LazyWeights

gguf = pytest.importorskip("gguf")


@pytest.fixture()
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> dict[str, kv_memory.LoadPhases]:
    """A CPU the backend takes for a GPU until its repack is done; returns what its check
    counted (``phases``: kv_memory.check_load_fits's)."""
    return stop_at_the_cache(monkeypatch)


def test_a_q4_k_m_loads_without_making_a_layer_matrix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stand_ins: dict[str, kv_memory.LoadPhases]
) -> None:
    from monokernel.weights.loader import load_checkpoint
    from monokernel.weights.test_gguf_loader import QT, k_quant_gguf

    edge = {"token_embd.weight": QT.Q4_K, "output.weight": QT.Q6_K}
    path = k_quant_gguf(tmp_path / "m.gguf", (QT.Q4_K, QT.Q6_K), edge=edge)
    ckpt = load_checkpoint(path, progress=False)
    assert ckpt.quantization == "int8" and ckpt.groups is not None
    assert isinstance(ckpt.weights, LazyWeights)
    made = count_dense(monkeypatch)
    # float32, as a caller that did not cast them hands them over: the backend's bf16 copy.
    weights = ckpt.weights
    packed = repacked_on_cpu(ckpt.config, weights, ckpt.quantization, ckpt.groups)
    assert made == []  # no layer matrix made dense, and no copy of one
    assert set(weights.unread()) == set(ckpt.groups)  # the caller's, left as they were
    assert len(packed.layers) == ckpt.config.num_layers
    assert packed.embed.dtype == torch.bfloat16
    # The check counted every packed layer as new (the layer matrices were never on the
    # device to be consumed), beside the bf16 copy of what was: what the repack keeps, but
    # for the layers' bf16 norms and biases, which consume frees once they are packed.
    cfg = ckpt.config
    tensors = [packed.embed, packed.lm_head, packed.norm_gain]
    for lp in packed.layers:
        tensors += [t for m in lp.matrices.values() for t in (m.data, *m.scales)]
        vectors = (lp.bqkv, lp.q_norm, lp.k_norm, lp.bo, lp.attn_gain, lp.ffn_gain)
        tensors += [v for v in vectors if v is not None]
    kept = sum(t.nbytes for t in tensors if t is not None)
    rest = 2 * cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    layer_vectors = cfg.num_parameters() - kv_memory.layer_matrix_params(cfg) - rest // 2
    counted = stand_ins["phases"].repack.weights
    assert kept <= counted <= kept + 2 * layer_vectors
