"""The tensor-parallel monokernel (TP=2) against the fp32 reference and the TP=1 kernel.

GPU tests (marker ``gpu``) need 2 Hopper GPUs with peer access and nvcc; the refusals at the
bottom run anywhere.
"""

from __future__ import annotations

import functools

import pytest
import torch

from monokernel import envs
from monokernel.errors import BackendUnavailableError
from monokernel.models.shapes import SHAPES
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.sampling import SamplingParams, probabilities
from monokernel.testing.gpu_models import needs_hopper_pair, needs_hopper_quad
from monokernel.testing.oracle import assert_logits_match, peaked
from monokernel.weights.random_weights import random_weights
from monokernel.weights.shard import TensorParallelError

PROMPT, STEPS = 64, 128


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _request(prompt: list[int], n: int, sampling: SamplingParams, stops=()) -> DecodeRequest:
    return DecodeRequest(tuple(prompt), sampling, n, frozenset(stops))


def _assert_same_tokens(got: list[int], want: list[int], what: str) -> None:
    """``got`` is ``want`` token for token; otherwise say where they first part."""
    assert len(got) == len(want), (what, len(got), len(want))
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    assert got == want, f"{what}: greedy tokens differ first at step {first}"


def _peaked(cfg, seed: int) -> dict[str, torch.Tensor]:
    """Random weights whose LM-head rows have heavy-tailed norms (testing.oracle.peaked)."""
    dev = torch.device("cuda", 0)
    return peaked(cfg, random_weights(cfg, device=dev, seed=seed))


@functools.lru_cache(maxsize=1)
def _tp_setup(shape: str):
    from monokernel.runtime.backends.monokernel.tp import MonokernelTPBackend

    cfg = SHAPES[shape]
    weights = _peaked(cfg, seed=11)
    return cfg, weights, MonokernelTPBackend(cfg, weights, 1024, torch.device("cuda", 0), 2)


@pytest.mark.gpu
@needs_hopper_pair
def test_tp2_teacher_forced_logits() -> None:
    cfg, weights, tp = _tp_setup("qwen2.5-coder-1.5b")
    seq = _tokens(PROMPT + STEPS, cfg.vocab_size, seed=1)
    got = tp.teacher_forced_logits(seq[:PROMPT], seq[PROMPT:])  # [STEPS, V], shards joined
    assert_logits_match(cfg, weights, seq, PROMPT, got, "TP=2 qwen2.5-coder-1.5b")


@pytest.mark.gpu
@needs_hopper_pair
@pytest.mark.parametrize("case", ["fp8", "int8", "int4", "fp8-tiles", "int4-tiles"])
def test_tp2_quantized_teacher_forced_logits(case: str) -> None:
    """--quantize at TP=2: each rank packs its blocks with TP=1's scales (int4: its whole
    groups), so the reference on the dequantised whole weights is the oracle, as at TP=1.
    "-tiles": the ranks' blocks in 16-row tiles (MONOKERNEL_WEIGHT_LAYOUT=tiles; a rank of
    this shape streams rows by default)."""
    from monokernel.runtime.backends.monokernel.tp import MonokernelTPBackend
    from monokernel.weights.quantize import DequantizedView

    fmt = case.removesuffix("-tiles")
    layout = "tiles" if case.endswith("-tiles") else "auto"
    cfg = SHAPES["llama-3.2-1b"]
    weights = random_weights(cfg, device=torch.device("cuda", 0), seed=12)
    # int4's prefill would multiply the prompt by its weights rounded to bf16: fp32 here, as
    # in the single-GPU int4 test.
    precision = "fp32" if fmt == "int4" else None
    with envs.overridden(MONOKERNEL_WEIGHT_LAYOUT=layout):
        tp = MonokernelTPBackend(
            cfg, weights, 512, torch.device("cuda", 0), 2, quantize=fmt,
            prefill_precision=precision,
        )  # fmt: skip
    assert all(bool(r.kernel.dims.weight_tiles) == (layout == "tiles") for r in tp.ranks)
    seq = _tokens(PROMPT + STEPS, cfg.vocab_size, seed=3)
    got = tp.teacher_forced_logits(seq[:PROMPT], seq[PROMPT:])
    tp.close()
    # The ranks' launches and frees make each GPU current in turn; the caller stays on its
    # own (a backend opened next on "cuda" must not land on the last rank's GPU).
    assert torch.cuda.current_device() == 0
    assert_logits_match(
        cfg, DequantizedView(weights, fmt), seq, PROMPT, got, f"TP=2 llama-3.2-1b {fmt}"
    )
    if case == "int4":
        # A 4-bit checkpoint's own groups (here the same rounding, as a checkpoint would hold
        # it), split over the ranks by shard_groups: the very logits --quantize int4 gave.
        from monokernel.weights.group_quant import quantize_rtn
        from monokernel.weights.quantize import int4_group_of, is_quantized

        group = int4_group_of(cfg)
        groups = {k: quantize_rtn(v, group) for k, v in weights.items() if is_quantized(k)}
        tp = MonokernelTPBackend(
            cfg, weights, 512, torch.device("cuda", 0), 2, "int4", groups, precision
        )
        again = tp.teacher_forced_logits(seq[:PROMPT], seq[PROMPT:])
        tp.close()
        assert torch.equal(again, got)
        # With input statistics (runtime/calibration.py; random here, skewed per column):
        # each rank's blocks, searched on the GPU with its slice of them, are the whole
        # matrix's groups searched with the whole vectors.
        gen = torch.Generator().manual_seed(5)
        act = {
            k: torch.rand(v.shape[1], generator=gen) ** 4 * 100
            for k, v in weights.items()
            if is_quantized(k)
        }
        tp = MonokernelTPBackend(
            cfg, weights, 512, torch.device("cuda", 0), 2, quantize="int4",
            prefill_precision=precision, act_stats=act,
        )  # fmt: skip
        weighted = tp.teacher_forced_logits(seq[:PROMPT], seq[PROMPT:])
        tp.close()
        groups = {k: quantize_rtn(v, group, act[k]) for k, v in weights.items() if is_quantized(k)}
        tp = MonokernelTPBackend(
            cfg, weights, 512, torch.device("cuda", 0), 2, "int4", groups, precision
        )
        whole = tp.teacher_forced_logits(seq[:PROMPT], seq[PROMPT:])
        tp.close()
        assert torch.equal(weighted, whole)
        assert not torch.equal(weighted, got)  # the statistics changed the grids


@pytest.mark.gpu
@needs_hopper_pair
@pytest.mark.parametrize("case", ["g16", "q4_k_m"])
def test_tp2_int8_groups_teacher_forced_logits(case: str) -> None:
    """A GGUF file's 5- to 8-bit layers at TP=2 (int8 groups of 16, each rank its blocks by
    shard_groups), and a Q4_K_M's mix (int4 tiles forced, QKV and down in int8 groups of 16:
    a stage format each on every rank): rel L2 <= 1e-2 against the reference on the groups'
    own values."""
    from monokernel.runtime.backends.monokernel.tp import MonokernelTPBackend
    from monokernel.weights.gguf_8bit import q4_k_m_groups, quantize_groups8
    from monokernel.weights.quantize import is_quantized

    cfg = SHAPES["llama-3.2-1b"]
    weights = random_weights(cfg, device=torch.device("cuda", 0), seed=14)
    if case == "g16":
        groups = {k: quantize_groups8(v, 16) for k, v in weights.items() if is_quantized(k)}
    else:
        groups = q4_k_m_groups(weights)
    with envs.overridden(MONOKERNEL_WEIGHT_LAYOUT="tiles" if case == "q4_k_m" else "auto"):
        tp = MonokernelTPBackend(
            cfg, weights, 512, torch.device("cuda", 0), 2, "int8", groups, "fp32"
        )
    want = [("int8", 16)] * 3 if case == "g16" else [("int4", 32), ("int8", 16), ("int8", 16)]
    assert all(r.kernel.dims.stage_formats() == want for r in tp.ranks)
    seq = _tokens(PROMPT + STEPS, cfg.vocab_size, seed=5)
    got = tp.teacher_forced_logits(seq[:PROMPT], seq[PROMPT:])
    tp.close()
    ref = {k: groups[k].dense() if k in groups else v for k, v in weights.items()}
    assert_logits_match(cfg, ref, seq, PROMPT, got, f"TP=2 llama-3.2-1b {case}")


@pytest.mark.gpu
@needs_hopper_pair
def test_tp2_fp8_blocks_teacher_forced_logits() -> None:
    """An FP8 checkpoint's 128 x 128 block scales at TP=2, each rank streaming its blocks of
    the checkpoint's values (ranks forced to tiles: this shape's ranks stream rows by
    default, where the blocks are re-quantised a row): the reference on the checkpoint's
    dequantised values is the oracle."""
    from monokernel.runtime.backends.monokernel.tp import MonokernelTPBackend
    from monokernel.weights.checkpoint_quant import fp8_block_checkpoint

    cfg = SHAPES["llama-3.2-1b"]
    weights = random_weights(cfg, device=torch.device("cuda", 0), seed=13)
    dense, blocks = fp8_block_checkpoint(weights, 128, 128)
    bf16 = {k: v.bfloat16() for k, v in dense.items()}
    with envs.overridden(MONOKERNEL_WEIGHT_LAYOUT="tiles"):
        tp = MonokernelTPBackend(
            cfg, bf16, 512, torch.device("cuda", 0), 2, "fp8", prefill_precision="fp32",
            fp8_blocks=blocks,
        )  # fmt: skip
    assert all(r.kernel.dims.kernel_format() == "Fp8BlockTiles<128>" for r in tp.ranks)
    seq = _tokens(PROMPT + STEPS, cfg.vocab_size, seed=4)
    got = tp.teacher_forced_logits(seq[:PROMPT], seq[PROMPT:])
    tp.close()
    assert_logits_match(cfg, dense, seq, PROMPT, got, "TP=2 llama-3.2-1b fp8 blocks 128x128")


GREEDY_CASES = [
    SamplingParams(temperature=0.0),
    # The penalties in every rank's LM head (sampling.cuh penalize), ids global.
    SamplingParams(
        temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, logit_bias={100: 5.0}
    ),
]


@pytest.mark.gpu
@needs_hopper_pair
@pytest.mark.parametrize("greedy", GREEDY_CASES, ids=["plain", "penalties"])
@pytest.mark.parametrize("source", ["prefill", "kernel"])
def test_tp2_greedy_matches_tp1(greedy: SamplingParams, source: str) -> None:
    """The first token from the ranks' prefill logits (their vocabulary ranges side by
    side) or from the kernels' first step: the same tokens as one GPU's either way."""
    from monokernel.runtime.backends.monokernel import MonokernelBackend

    cfg, weights, tp = _tp_setup("qwen2.5-coder-1.5b")
    prompt = _tokens(PROMPT, cfg.vocab_size, seed=2)
    kept, tp.first_from_prefill = tp.first_from_prefill, source == "prefill"
    try:
        got = list(tp.stream(_request(prompt, STEPS, greedy), CancelToken()))
        # max_tokens 1, and a first token that is a stop id: no kernel launch at all.
        assert list(tp.stream(_request(prompt, 1, greedy), CancelToken())) == got[:1]
        stopped = list(tp.stream(_request(prompt, 8, greedy, stops=got[:1]), CancelToken()))
        assert stopped == got[:1]
    finally:
        tp.first_from_prefill = kept
    one = MonokernelBackend(cfg, weights, 1024, torch.device("cuda", 0), first_token=source)
    want = list(one.stream(_request(prompt, STEPS, greedy), CancelToken()))
    one.close()
    assert len(got) == STEPS
    _assert_same_tokens(got, want, f"TP=2 against TP=1 (first token from the {source})")


@pytest.mark.gpu
@needs_hopper_quad
def test_tp4_teacher_forced_logits_and_greedy_matches_tp1() -> None:
    """Four ranks: the all-reduce sums four slots (two more fetch rounds than at TP=2), the
    token exchange four units; the logits match the fp32 reference and greedy decoding
    gives TP=1's tokens."""
    from monokernel.runtime.backends.monokernel import MonokernelBackend
    from monokernel.runtime.backends.monokernel.tp import MonokernelTPBackend

    cfg = SHAPES["llama-3.2-1b"]  # 8 KV heads: 4 ranks of 2
    weights = _peaked(cfg, seed=12)
    tp = MonokernelTPBackend(cfg, weights, 1024, torch.device("cuda", 0), 4)
    seq = _tokens(PROMPT + STEPS, cfg.vocab_size, seed=4)
    got = tp.teacher_forced_logits(seq[:PROMPT], seq[PROMPT:])
    assert_logits_match(cfg, weights, seq, PROMPT, got, "TP=4 llama-3.2-1b")
    prompt = _tokens(PROMPT, cfg.vocab_size, seed=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=STEPS)
    tokens = list(tp.stream(_request(prompt, STEPS, greedy), CancelToken()))
    tp.close()
    one = MonokernelBackend(cfg, weights, 1024, torch.device("cuda", 0))
    want = list(one.stream(_request(prompt, STEPS, greedy), CancelToken()))
    one.close()
    _assert_same_tokens(tokens, want, "TP=4 against TP=1")


@pytest.mark.gpu
@needs_hopper_pair
def test_tp2_profile_times_every_rank() -> None:
    """profile_step reads each rank's stage marks: every rank's stages add up to its step, and
    the ranks, which wait on each other's partial sums twice a layer, take the same step."""
    cfg, _, tp = _tp_setup("qwen2.5-coder-1.5b")
    prof = tp.profile_step(_tokens(PROMPT, cfg.vocab_size, seed=3), 16, 8)
    ranks = [
        {k: v for k, v in prof.items() if not k.startswith("r1.")},
        {k[3:]: v for k, v in prof.items() if k.startswith("r1.")},
    ]
    for r, stages in enumerate(ranks):
        parts = sum(v for k, v in stages.items() if k.count(".") == 1)  # <stage>.work / .wait
        assert stages["total"] > 0, r
        assert abs(parts - stages["total"]) <= 1e-3 * stages["total"], (r, parts, stages)
    assert abs(prof["total"] - prof["r1.total"]) <= 0.1 * prof["total"]


@pytest.mark.gpu
@needs_hopper_pair
def test_tp2_graphed_prefill_fills_the_caches_as_the_eager_one() -> None:
    """Each rank's prefill graph (captured at load, its exchanges inside) fills every rank's
    cache as the eager sharded prefill does (cuBLAS may pick other kernels for a padded
    bucket's rows: close, not bitwise), and a request decodes the same."""
    cfg, _, tp = _tp_setup("qwen2.5-coder-1.5b")
    sp = tp.prefill
    assert sp.graphs is not None and sp.graphs.captured()
    for n in (5, 64, 300):
        prompt = _tokens(n, cfg.vocab_size, seed=n)
        caches = []
        for graphs in (sp.graphs, None):
            kept, sp.graphs = sp.graphs, graphs
            try:
                sp.run(prompt, 0)
            finally:
                sp.graphs = kept
            for rk in tp.ranks:
                torch.cuda.synchronize(rk.device)
            caches.append([(rk.cache.k[:, :, :n].float(), rk.cache.v[:, :, :n].float())
                           for rk in tp.ranks])  # fmt: skip
        for (kg, vg), (ke, ve) in zip(*caches, strict=True):
            assert float((kg - ke).norm() / ke.norm()) < 2e-3, n
            assert float((vg - ve).norm() / ve.norm()) < 2e-3, n
    prompt = _tokens(PROMPT, cfg.vocab_size, seed=8)
    greedy = SamplingParams(temperature=0.0)
    got = list(tp.stream(_request(prompt, 32, greedy), CancelToken()))
    kept, sp.graphs = sp.graphs, None
    try:
        want = list(tp.stream(_request(prompt, 32, greedy), CancelToken()))
    finally:
        sp.graphs = kept
    assert got == want


@pytest.mark.gpu
@needs_hopper_pair
def test_tp2_sampling_stops_cancel_and_next_request() -> None:
    cfg, _, tp = _tp_setup("qwen2.5-coder-1.5b")
    prompt = _tokens(12, cfg.vocab_size, seed=6)
    greedy = SamplingParams(temperature=0.0)
    want = list(tp.stream(_request(prompt, 40, greedy), CancelToken()))
    assert len(want) == 40
    # Temperature sampling: the same seed draws the same tokens, another seed others.
    sp = SamplingParams(temperature=0.8, seed=123)
    runs = [list(tp.stream(_request(prompt, 32, sp), CancelToken())) for _ in range(2)]
    assert runs[0] == runs[1]
    other = SamplingParams(temperature=0.8, seed=124)
    assert list(tp.stream(_request(prompt, 32, other), CancelToken())) != runs[0]
    # A stop id ends the stream right after it is yielded, on every rank at once.
    stop_at = want[10]
    got = list(tp.stream(_request(prompt, 40, greedy, stops=[stop_at]), CancelToken()))
    assert got == want[: want.index(stop_at) + 1]
    # Cancel mid-stream: the stream ends, both kernels are gone, the next request is right.
    cancel = CancelToken()
    it = tp.stream(_request(prompt, 900, greedy), cancel)
    head = [next(it) for _ in range(5)]
    cancel.set()
    assert head == want[:5] and list(it) == []
    assert list(tp.stream(_request(prompt, 40, greedy), CancelToken())) == want
    it = tp.stream(_request(prompt, 900, greedy), CancelToken())
    next(it)
    it.close()
    assert list(tp.stream(_request(prompt, 40, greedy), CancelToken())) == want
    # top-k / top-p: the same seed draws the same tokens; top-k 1 is greedy.
    sp = SamplingParams(temperature=0.9, top_k=30, top_p=0.9, seed=7)
    runs = [list(tp.stream(_request(prompt, 32, sp), CancelToken())) for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 32
    one = SamplingParams(temperature=1.0, top_k=1, seed=8)
    assert list(tp.stream(_request(prompt, 40, one), CancelToken())) == want


@pytest.mark.gpu
@needs_hopper_pair
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tp2_logprobs_are_the_raw_logits_log_softmax(temperature: float) -> None:
    """Rank 0 gathers every rank's raw logits and writes each step's record: it is
    runtime/logprobs.py's on the kernels' own logits of that step (the ranks' shards side by
    side), and each token is the host rule's on them (a penalty, so raw differs from drawn)."""
    from monokernel.runtime.backends.monokernel.kernel import Probe
    from monokernel.runtime.logprobs import TokenLogprobs, token_logprobs
    from monokernel.runtime.sampling import penalize, sample

    cfg, _, tp = _tp_setup("qwen2.5-coder-1.5b")
    steps = 40
    sampling = SamplingParams(
        temperature=temperature, seed=9, logprobs=5, frequency_penalty=0.5, top_p=0.95
    )
    prompt = _tokens(PROMPT, cfg.vocab_size, seed=4)
    shards = [
        torch.full((steps, rk.cfg.vocab_size), float("nan"), device=rk.device) for rk in tp.ranks
    ]
    lps: list[TokenLogprobs] = []
    probes = [Probe(debug_logits=s) for s in shards]
    got = list(tp._run(prompt, steps, sampling, (), None, probes, lps))
    raw = torch.cat([s.cpu() for s in shards], dim=1)
    assert len(got) == len(lps) == steps
    replayed: list[int] = []
    for s, (token, lp) in enumerate(zip(got, lps, strict=True)):
        z = penalize(raw[s], sampling, prompt, replayed)
        replayed.append(sample(z, sampling, len(prompt) + s))
        want = token_logprobs(raw[s], token, 5)
        assert abs(lp.logprob - want.logprob) <= 1e-4, (s, lp, want)
        assert [i for i, _ in lp.top] == [i for i, _ in want.top], (s, lp, want)
        for (_, a), (_, b) in zip(lp.top, want.top, strict=True):
            assert abs(a - b) <= 1e-4, (s, lp, want)
    assert got == replayed


@pytest.mark.gpu
@needs_hopper_pair
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, 20, 1.0), (1.2, 50, 0.9)])
def test_tp2_filtered_sampling_distribution(temperature: float, top_k: int, top_p: float) -> None:
    """Under TP every rank draws from the whole vocabulary's logits: token frequencies over
    many seeds follow softmax(z) on the kept set of the TP kernel's own logits. Plain random
    weights (the peaked ones of the other tests put all the mass on one token)."""
    from monokernel.runtime.backends.monokernel.test_backend import _chi2_pvalue
    from monokernel.runtime.backends.monokernel.tp import MonokernelTPBackend

    cfg = SHAPES["qwen2.5-coder-1.5b"]
    weights = random_weights(cfg, device=torch.device("cuda", 0), seed=13)
    tp = MonokernelTPBackend(cfg, weights, 64, torch.device("cuda", 0), 2)
    del weights
    draws = 800
    prefix = _tokens(11, cfg.vocab_size, seed=4)
    logits = tp.teacher_forced_logits(prefix, [0])[0]  # the first step's, as stream draws it
    counts = torch.zeros(cfg.vocab_size, dtype=torch.float64)
    for seed in range(draws):
        sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        counts[next(iter(tp.stream(_request(prefix, 1, sp), CancelToken())))] += 1
    tp.close()
    want = probabilities(
        logits.cpu(), SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ).double()
    assert int((want * draws >= 5).sum()) >= 3, "too peaked a distribution to test"
    top = torch.argsort(want, descending=True)[:6].tolist()
    seen = torch.argsort(counts, descending=True)[:6].tolist()
    why = (
        f"expected {[(i, round(float(want[i]) * draws, 1)) for i in top]}, "
        f"drew {[(i, int(counts[i])) for i in seen]}"
    )
    assert counts[want == 0].sum() == 0, f"drew a token outside the top-k/top-p set: {why}"
    p = _chi2_pvalue(counts, want)
    assert p > 1e-3, f"chi-square p-value {p:.2e}: {why}"


def test_tp_that_does_not_divide_the_heads_is_refused() -> None:
    from monokernel.runtime.backends.monokernel.tp import MonokernelTPBackend

    cfg = SHAPES["qwen2.5-coder-1.5b"]  # 2 KV heads: only 1 and 2 are valid
    with pytest.raises(TensorParallelError, match="valid sizes for this model: 1, 2"):
        MonokernelTPBackend(cfg, {}, 128, torch.device("cuda", 0), 4)


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() >= 8, reason="has 8 GPUs"
)
def test_more_ranks_than_gpus_is_refused() -> None:
    from monokernel.runtime.backends.monokernel.tp import MonokernelTPBackend

    cfg = SHAPES["llama-3.2-1b"]
    with pytest.raises(BackendUnavailableError, match="--tp 8 needs"):
        MonokernelTPBackend(cfg, {}, 128, torch.device("cuda", 0), 8)


def test_a_rank_frees_its_groups_as_it_packs_and_allocates_its_cache_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU, the kernel, its prefill and its receive buffer stood in for: a rank's
    blocks of the groups (--quantize int4's, made by rank_tensors) go a layer at a time as
    the repack packs them, so none is left when the cache is allocated, after the repack
    (runtime/memory_plan.py counts the rank's load in those two phases)."""
    import contextlib
    import types
    import weakref

    from monokernel.models.config import ModelConfig
    from monokernel.runtime.backends.monokernel import tp
    from monokernel.weights.quantize import int4_group_of
    from monokernel.weights.shard import shard_config

    # Column blocks at --tp 2 (q 128, intermediate 256) that are whole int4 groups of 128.
    cfg = ModelConfig(
        family="llama",
        vocab_size=97,
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    cpu = torch.device("cpu")
    shard, mine = tp.rank_tensors(
        cfg, random_weights(cfg, seed=3), 0, 2, cpu, "int4", group=int4_group_of(cfg)
    )
    assert mine is not None and len(mine) == 7 * cfg.num_layers
    alive = {k: weakref.ref(g.q) for k, g in mine.items()}
    events: list[str] = []
    real_repack = tp.repack

    def repack(*args: object, **kwargs: object) -> object:
        events.append("repack")
        return real_repack(*args, **kwargs)  # type: ignore[arg-type]

    def allocate(*args: object) -> object:
        left = sorted(k for k, ref in alive.items() if ref() is not None)
        events.append(f"cache ({len(left)} groups left)")
        return types.SimpleNamespace(k=None, v=None)

    class Stub:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

    monkeypatch.setattr(tp, "repack", repack)
    monkeypatch.setattr(tp.KVCache, "allocate", allocate)
    monkeypatch.setattr(tp, "kernel_dims", lambda *args, **kwargs: None)
    monkeypatch.setattr(tp, "DecodeKernel", Stub)
    monkeypatch.setattr(tp, "Prefiller", Stub)
    monkeypatch.setattr(tp, "DeviceBuffer", Stub)
    monkeypatch.setattr(tp.torch.cuda, "device", lambda device: contextlib.nullcontext())
    rank = tp.Rank(shard_config(cfg, 0, 2), shard, 64, cpu, "int4", None, mine)
    assert events == ["repack", "cache (0 groups left)"]
    assert mine == {} and not [k for k in shard if k.startswith("layers.")]
    assert len(rank.kernel.__dict__) == 0  # the stand-in
