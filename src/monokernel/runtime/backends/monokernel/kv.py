"""The kernel's KV cache and what reuses it: the prefill that fills it, the prefix cache, the
snapshots of earlier conversations.

Prefill (``runtime/prefill.py``: cuBLAS GEMMs and flash attention, in chunks) writes the
prompt's K/V straight into the kernel's bf16 cache [layers, kv_heads, max_len, head_dim].
The cache keeps what the last request left in it (its prompt and the generated tokens whose
K/V the kernel wrote), and optionally snapshots of earlier conversations
(``runtime/prefix_cache.py``); a prompt sharing a prefix with either prefills only the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from monokernel.errors import InvalidRequestError
from monokernel.models.config import ModelConfig
from monokernel.models.transformer import KVCache
from monokernel.runtime import kv_memory
from monokernel.runtime.kv_filler import CacheFiller
from monokernel.runtime.prefill import Prefiller, workspace_bytes
from monokernel.runtime.prefix_cache import PrefixCache
from monokernel.weights.repack import Repacked


class KVStore:
    """The cache of ``max_seq_len`` positions on ``device``, its prefill over ``packed`` (in
    chunks of ``chunk`` tokens at ``precision``), and prefix reuse (``prefix_reuse``) with
    ``snapshot_bytes`` for snapshots."""

    def __init__(
        self,
        cfg: ModelConfig,
        packed: Repacked,
        max_seq_len: int,
        device: torch.device,
        chunk: int,
        precision: str,
        prefix_reuse: bool,
        snapshot_bytes: int,
    ) -> None:
        self.cfg, self.max_seq_len, self.device = cfg, max_seq_len, device
        # [L, kvh, max_len, d] x2, bf16: the reference's layout, which the kernel reads too
        self.cache = KVCache.allocate(cfg, max_seq_len, torch.bfloat16, device)
        self.prefill = Prefiller(cfg, packed, self.cache.k, self.cache.v, chunk, precision)
        self._workspace = workspace_bytes(
            cfg, min(chunk, max_seq_len), max_seq_len, precision, packed.format, packed.head_format
        )
        per_token = kv_memory.kv_bytes_per_token(cfg)
        self.prefix = PrefixCache(per_token, snapshot_bytes, enabled=prefix_reuse)
        self.filler = CacheFiller(self.prefill, self.prefix, self._snapshot_fits)

    @staticmethod
    def default_snapshot_bytes(cfg: ModelConfig, max_seq_len: int, spare: int) -> int:
        """Twice the cache, at most a quarter of ``spare`` (the memory left after loading)."""
        return min(2 * kv_memory.kv_bytes_per_token(cfg) * max_seq_len, max(0, spare) // 4)

    def _snapshot_fits(self, nbytes: int) -> bool:
        need = nbytes + self._workspace + kv_memory.RESERVE_BYTES
        return kv_memory.free_device_bytes(self.device) >= need

    def weights_movable(self) -> bool:
        """Whether the weights may move: not once the prefill's CUDA graphs hold them."""
        graphs = self.prefill.graphs
        return graphs is None or not graphs.captured()

    def set_prefix_reuse(self, enabled: bool) -> None:
        """Turn prefix reuse on or off (off: every request prefills its whole prompt). Either
        way the snapshots are freed and the live cache's contents forgotten, so what a
        request reuses next was computed under the new setting."""
        self.prefix.enabled = enabled
        self.prefix.clear()

    def prefill_logits(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """Prefill ``prompt_ids`` (reusing a cached prefix like a request would) and return
        the last token's logits [V] float32, from the prefill path alone (no kernel)."""
        n = len(prompt_ids)
        if not 0 < n <= self.max_seq_len:
            raise InvalidRequestError(f"prompt length {n} must be in [1, {self.max_seq_len}]")
        if any(not 0 <= t < self.cfg.vocab_size for t in prompt_ids):
            raise InvalidRequestError("a prompt token id is outside the vocabulary")
        with torch.cuda.device(self.device):
            logits = self.filler.fill(prompt_ids, n, logits=True)
            torch.cuda.synchronize(self.device)
        assert logits is not None
        return logits

    def close(self) -> None:
        """Free the snapshots and the prefill graphs' memory pool (idempotent)."""
        self.prefix.clear()
        if self.prefill.graphs is not None:
            self.prefill.graphs.clear()
