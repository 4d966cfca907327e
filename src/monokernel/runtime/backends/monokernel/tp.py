"""Tensor-parallel monokernel: one request split over N GPUs of one node, one process.

Each rank runs its own persistent kernel (a ``-DMK_TP=N`` build with the rank's dims: heads/N,
kv_heads/N, intermediate/N, its vocabulary rows) on its own GPU. The two residual reductions
per layer and the token choice happen inside the kernels, by storing tagged partials straight
into the peers' receive buffers over NVLink (``kernels/csrc/tp.cuh``): no NCCL, no host step
per token. docs/tensor-parallel.md has the design.

Composition, not a copy: each rank is the single-GPU backend's DecodeKernel (kernel.py) over
the rank's repacked shard and KV cache, plus its receive buffer (peer.py); this class adds
the sharding, the unsharded prefill and the N-way launch. Prefill runs the reference model
once on rank 0's GPU and each rank gets its KV heads' slice of the cache, which is exact.

Limits: greedy and plain temperature sampling only (top-k / top-p need the whole vocabulary
and are refused); NVLink multicast is never used.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from monokernel import envs
from monokernel.errors import BackendUnavailableError, EngineFailedError, InvalidRequestError
from monokernel.kernels import layout
from monokernel.models.config import ModelConfig
from monokernel.models.transformer import Float32View, KVCache, Transformer
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.backends.monokernel.kernel import (
    NO_PROBE,
    STOP_GRACE_SECONDS,
    DecodeKernel,
    KernelStuckError,
    Launch,
    Probe,
    TPLink,
    kernel_dims,
    monokernel_supported,
    stall_seconds,
)
from monokernel.runtime.backends.monokernel.peer import (
    DeviceBuffer,
    enable_peer_access,
    multicast_off,
)
from monokernel.runtime.backends.monokernel.request import checked_steps
from monokernel.runtime.backends.monokernel.token_reader import read_tokens
from monokernel.runtime.sampling import SamplingParams
from monokernel.weights.formats import DEFAULT_FORMAT
from monokernel.weights.names import Weights
from monokernel.weights.quantize import DequantizedView, check_method, whole_row_scales
from monokernel.weights.repack import repack
from monokernel.weights.shard import (
    ShardConfig,
    check_tp,
    rank_config,
    shard_config,
    shard_weights,
)

_TAG_LIMIT = 2**32 - 1  # tags are u32 and never 0 (the zeroed buffers' value)


def refuse_filtered(sampling: SamplingParams, tp: int) -> None:
    """top-k / top-p need global thresholds over the split vocabulary: not implemented."""
    if tp > 1 and not sampling.greedy and (sampling.top_k > 0 or sampling.top_p < 1.0):
        raise InvalidRequestError(
            f"top-k / top-p sampling is not supported with tensor parallelism (--tp {tp}) yet; "
            "use greedy or plain temperature sampling, or --tp 1"
        )


class Rank:
    """One rank: its shard's kernel, KV cache and receive buffer, on ``device`` (no prefill
    of its own: prefill is unsharded, on rank 0)."""

    def __init__(
        self,
        sc: ShardConfig,
        weights: Weights,
        max_seq_len: int,
        device: torch.device,
        fmt: str = DEFAULT_FORMAT,
        row_scales: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """``fmt``: the layers' weight format; ``row_scales``: the column-split matrices'
        whole rows' scales (a quantised format's, weights/quantize.py whole_row_scales)."""
        cfg = rank_config(sc)
        self.sc, self.cfg, self.device = sc, cfg, device
        dims = kernel_dims(cfg, tp=sc.tp, weight_format=fmt)
        with torch.cuda.device(device):
            self.cache = KVCache.allocate(cfg, max_seq_len, torch.bfloat16, device)
            packed = repack(cfg, weights, max_seq_len, fold=False, fmt=fmt, row_scales=row_scales)
            self.kernel = DecodeKernel(cfg, dims, packed, self.cache, max_seq_len, device)
        self.recv = DeviceBuffer(device.index, layout.tp_recv_bytes(sc.tp, cfg.hidden_size))

    def close(self) -> None:
        self.recv.free()
        self.kernel.make_current()
        self.kernel.close()


class MonokernelTPBackend:
    name = "monokernel"

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Weights,
        max_seq_len: int,
        device: torch.device,
        tp: int,
        quantize: str | None = None,
    ) -> None:
        """``quantize``: the layers' matrices in that format (--quantize), packed per rank
        with TP=1's scales, so every rank count computes the same quantised model."""
        multicast_off()  # nothing here uses NVLS; keep any library we load off it too
        check_tp(cfg, tp)  # TensorParallelError naming the numbers and the valid sizes
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise BackendUnavailableError(f"--tp {tp} needs {tp} NVIDIA GPUs")
        first = device.index if device.index is not None else torch.cuda.current_device()
        count = torch.cuda.device_count()
        if first + tp > count:
            raise BackendUnavailableError(
                f"--tp {tp} needs {tp} GPUs from cuda:{first} on; {count} visible"
            )
        self.devices = [torch.device("cuda", first + r) for r in range(tp)]
        for d in self.devices:
            ok, why = monokernel_supported(d)
            if not ok:
                raise BackendUnavailableError(f"engine 'monokernel' cannot run on {d}: {why}")
        enable_peer_access([d.index for d in self.devices])
        self.cfg, self.tp, self.max_seq_len = cfg, tp, max_seq_len
        self.device = self.devices[0]
        if weights["embed"].dtype != torch.bfloat16:
            weights = {k: v.to(torch.bfloat16) for k, v in weights.items()}
        weights = {k: v.to(self.device) for k, v in weights.items()}
        fmt = DEFAULT_FORMAT if quantize is None else check_method(quantize)
        if fmt == "int4":
            raise InvalidRequestError(
                "int4 weights at --tp > 1: the tensor-parallel build streams bf16, fp8 or int8 "
                "(--quantize fp8 or int8; a 4-bit checkpoint runs at --tp 1)"
            )
        # Unsharded fp32 prefill on rank 0 (as the single-GPU backend does), on the values
        # the kernels multiply by.
        view = Float32View(weights) if quantize is None else DequantizedView(weights, fmt)
        self.ref = Transformer(cfg, view, max_seq_len)
        scales = None if quantize is None else whole_row_scales(weights, fmt, cfg.num_layers)
        self.ranks: list[Rank] = []
        for r, dev in enumerate(self.devices):
            shard = {k: v.to(dev) for k, v in shard_weights(cfg, weights, r, tp).items()}
            mine = None if scales is None else {k: v.to(dev) for k, v in scales.items()}
            self.ranks.append(Rank(shard_config(cfg, r, tp), shard, max_seq_len, dev, fmt, mine))
            del shard
        self._tag = 1  # next generation; carried across requests so buffers are never reset
        self.failure: str | None = None  # why no more requests can run (RequestDriver's)
        if envs.MONOKERNEL_PREFILL_WARMUP:
            # A two-token request now, so the first real one pays none of the first-use costs
            # (the ranks' first launches, the prefill's first kernels); each request prefills
            # its whole prompt, so what it leaves in the caches is never read.
            for _ in self._run((0, 0), 2, SamplingParams(temperature=0.0), [], None):
                pass

    # ---- one request --------------------------------------------------------------------

    def _reset_tags(self) -> None:
        """Zero every receive buffer and restart the tags (before u32 tags would wrap)."""
        for rk in self.ranks:
            rk.recv.zero()
        self._tag = 1

    def _prefill(self, prompt_ids: Sequence[int]) -> None:
        n = len(prompt_ids)
        if n <= 1:
            return
        cfg = self.cfg
        with torch.cuda.device(self.device):
            prompt = torch.tensor(prompt_ids[:-1], dtype=torch.long, device=self.device)
            tmp = KVCache.allocate(cfg, n - 1, torch.float32, self.device)
            self.ref.prefill(prompt, tmp)
            for rk in self.ranks:
                h0, h1 = rk.sc.rank * rk.sc.kv_heads, (rk.sc.rank + 1) * rk.sc.kv_heads
                rk.cache.k[:, :, : n - 1].copy_(tmp.k[:, h0:h1].to(rk.device))
                rk.cache.v[:, :, : n - 1].copy_(tmp.v[:, h0:h1].to(rk.device))
            torch.cuda.synchronize(self.device)
            del tmp

    def _run(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        stop_ids: Sequence[int],
        cancel: CancelToken | None,
        probes: Sequence[Probe] | None = None,
    ) -> Iterator[int]:
        """``probes``: each rank's debug inputs (forced tokens, its logits shard)."""
        if self.failure is not None:
            raise EngineFailedError(self.failure)
        n = len(prompt_ids)
        n_steps = checked_steps(
            prompt_ids, stop_ids, max_new_tokens, self.max_seq_len, self.cfg.vocab_size
        )
        refuse_filtered(sampling, self.tp)
        span = 2 * self.cfg.num_layers * max(n_steps, 1)  # tags this launch may use
        if self._tag + span >= _TAG_LIMIT:
            self._reset_tags()
        tag = self._tag
        self._tag += span  # advanced up front: an aborted launch never has its tags reused
        self._prefill(prompt_ids)
        launch = Launch(prompt_ids[-1], n - 1, n_steps, sampling, len(stop_ids))
        peers = [rk.recv.ptr for rk in self.ranks]
        params = []
        for r, rk in enumerate(self.ranks):
            rk.kernel.make_current()
            rk.kernel.prepare(stop_ids)
            link = TPLink(peers, rk.recv.ptr, rk.sc.rank, rk.sc.vocab_start, tag)
            params.append(rk.kernel.params(launch, NO_PROBE if probes is None else probes[r], link))
        lead = self.ranks[0].kernel  # rank 0 writes the tokens and reads the cancel word
        out = lead.token_words
        lead.clear_host_words(n_steps)
        # All N kernels spin on each other, so all must be resident together: launch each on
        # its own stream and device, back to back, never waiting in between.
        for rk, p in zip(self.ranks, params, strict=True):
            rk.kernel.make_current()
            rk.kernel.launch(p, n - 1 + n_steps)
        finished = False

        def check(stalled_s: float) -> None:
            for rk in self.ranks[1:]:  # raises on a fault of any rank
                rk.kernel.make_current()
                rk.kernel.finished()
            lead.make_current()
            if lead.finished() and not out[1]:
                raise KernelStuckError("the monokernel (rank 0) exited without finishing")
            if stalled_s > stall_seconds():
                raise KernelStuckError(
                    f"the TP monokernels produced no token for {stall_seconds():.0f} s "
                    "(MONOKERNEL_STALL_SECONDS)"
                )

        failed = False
        try:
            finished = yield from read_tokens(out, cancel, check)
        except GeneratorExit:
            raise
        except BaseException:
            failed = True
            raise
        finally:
            if not finished:
                lead.cancel()  # rank 0 reads it once per token and tells the others
            try:
                for rk in self.ranks:
                    rk.kernel.wait(STOP_GRACE_SECONDS if failed else None)
            except RuntimeError as e:  # still running when cancelled, or faulted
                self.failure = f"the TP monokernels cannot run more requests ({e}); restart"
                raise EngineFailedError(self.failure) from e

    # ---- the Backend contract -------------------------------------------------------------

    def stream(self, request: DecodeRequest, cancel: CancelToken) -> Iterator[int]:
        yield from self._run(
            request.prompt_ids,
            request.max_new_tokens,
            request.sampling,
            sorted(request.stop_token_ids),
            cancel,
        )

    def teacher_forced_logits(
        self, prompt_ids: Sequence[int], next_ids: Sequence[int]
    ) -> torch.Tensor:
        """Debug mode: logits [len(next_ids), V] float32 on rank 0's GPU, the ranks' vocabulary
        shards side by side; step s feeds the given token instead of the kernel's sample."""
        steps = len(next_ids)
        forced_list = [prompt_ids[-1], *next_ids[:-1]]
        forced = [
            torch.tensor(forced_list, dtype=torch.int32, device=rk.device) for rk in self.ranks
        ]  # [steps] per rank
        shards = [
            torch.full(
                (steps, rk.cfg.vocab_size), float("nan"), dtype=torch.float32, device=rk.device
            )
            for rk in self.ranks
        ]  # [steps, V_rank] per rank
        probes = [Probe(forced=f, debug_logits=s) for f, s in zip(forced, shards, strict=True)]
        greedy = SamplingParams(temperature=0.0, max_tokens=max(steps, 1))
        produced = sum(1 for _ in self._run(prompt_ids, steps, greedy, (), None, probes))
        if produced != steps:
            raise RuntimeError(f"the kernels ran {produced} of {steps} forced steps")
        for rk in self.ranks:
            torch.cuda.synchronize(rk.device)
        return torch.cat([s.to(self.device) for s in shards], dim=1)

    def close(self) -> None:
        for rk in self.ranks:
            rk.close()
        self.ranks = []
        del self.ref
