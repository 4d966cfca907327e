"""The CPU decode step on 4- and 8-bit matrices (cpu_packed.py) against the float32 reference.

Not bitwise: each matrix input is rounded to bf16 (2^-9 relative) and the kernels return
bf16, so logits differ from the reference's on the same dequantised values by ~1% of their
spread (the tolerance below). Greedy tokens match where the logits have no near ties, which
``logit_scale`` provides as in the other engine tests. What is bitwise: a forward of several
tokens against as many single steps, hence speculation against plain decoding.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from monokernel.models.config import ModelConfig
from monokernel.models.shapes import SHAPES
from monokernel.models.transformer import Transformer
from monokernel.runtime.backends import construct_backend, cpu_packed, resolve_engine
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.backends.cpu_packed import (
    GROUP,
    PICK,
    PackedCpuStep,
    best_row,
    candidates,
    int4_grid,
    pack_int4_rtn,
    pack_linear,
)
from monokernel.runtime.backends.reference import ReferenceBackend
from monokernel.runtime.backends.torch_compiled import TorchBackend
from monokernel.runtime.sampling import SamplingParams
from monokernel.runtime.speculative import SpeculativeConfig
from monokernel.testing.counted import Counted
from monokernel.weights.group_quant import quantize_rtn
from monokernel.weights.quantize import LINEAR_NAMES
from monokernel.weights.random_weights import random_weights
from monokernel.weights.test_repack import CONFIGS

CPU = torch.device("cpu")
# |packed - reference| / the reference logits' spread (max - min): measured 0.3-0.8% on these
# small random models (bf16 inputs to every matrix, bf16 logits outside the rescored top).
LOGIT_TOL = 0.02
# A greedy pick is decided where the best logit beats the second by this much of the spread:
# the rescored candidates' error was at most 0.6% of it.
DECIDED = 0.02
_TIED = CONFIGS["llama3-tied"]
SMALL = {
    **CONFIGS,
    # Widths neither integer kernel takes (cols % 8 != 0): every matrix stays float32.
    "ragged": dataclasses.replace(
        _TIED, hidden_size=44, intermediate_size=60, num_heads=2, head_dim=22
    ),
    # Every matrix fits the int4 kernel (rows % 16, cols % 32), the LM head too (the greedy
    # step's 4-bit candidates); weights on Q4_1 grids.
    "int4": dataclasses.replace(
        _TIED,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    ),
}
REAL = SHAPES["smollm2-135m"]  # the default model's shape


def q4_1(w: torch.Tensor) -> torch.Tensor:
    """``w`` through a GGUF Q4_1 round trip, as the loader dequantises it: per block of 32,
    fp16 d = (max - min) / 15 and m = min, q = round((w - m) / d), then q * d + m in
    float32."""
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // GROUP, GROUP)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    q = ((g - m) / d).round().clamp(0, 15)
    return (q * d + m).reshape(rows, cols)


def q4_1_weights(cfg: ModelConfig, seed: int, logit_scale: float) -> dict[str, torch.Tensor]:
    """Random float32 weights whose layer matrices lie on Q4_1 grids, as the default
    model's do (its embedding is Q8_0, so here it stays as drawn)."""
    weights = random_weights(cfg, dtype=torch.float32, seed=seed, logit_scale=logit_scale)
    for name, t in weights.items():
        if name.rsplit(".", 1)[-1] in LINEAR_NAMES:
            weights[name] = q4_1(t)
    return weights


def dequantized(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` with each layer matrix replaced by the values its packed form multiplies
    by (a matrix packs row by row alike alone or fused with others)."""
    out = dict(weights)
    for name, t in weights.items():
        if name.rsplit(".", 1)[-1] in LINEAR_NAMES:
            out[name] = pack_linear(t).dense()
    return out


def _prompt(cfg: ModelConfig, n: int = 12, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n,), generator=gen)


def test_a_q4_1_matrix_packs_as_int4_with_its_own_grid() -> None:
    w = q4_1(torch.randn(48, 96))
    grid = int4_grid(w)
    assert grid is not None
    q, scale, zero = grid
    assert torch.allclose(
        (q - 8) * scale.repeat_interleave(GROUP, 1) + zero.repeat_interleave(GROUP, 1), w, atol=1e-6
    )
    packed = pack_linear(w)
    assert packed.kind == "int4"
    # Only the bf16 rounding of each group's scale and zero: far below one grid step.
    step = scale.repeat_interleave(GROUP, 1)
    assert ((packed.dense() - w).abs() <= 0.05 * step + 1e-6).all()
    x = torch.randn(3, 96)
    want = x.bfloat16().float() @ packed.dense().T
    assert torch.allclose(packed(x).float(), want, rtol=1e-2, atol=1e-2 * want.abs().max())


def test_a_checkpoints_own_groups_pack_as_int4_without_a_grid_search(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Groups of 32 from the checkpoint (Checkpoint.groups): int4 as they are, with no search
    of the values for a grid; other group sizes fall back to the values."""
    gq = quantize_rtn(torch.randn(48, 96), GROUP)
    w = gq.dense()

    def no_search(_w: torch.Tensor) -> None:
        raise AssertionError("searched the values for a grid")

    with monkeypatch.context() as m:
        m.setattr(cpu_packed, "int4_grid", no_search)
        packed = pack_linear(w, gq=gq)
    assert packed.kind == "int4"
    step = gq.scale.repeat_interleave(GROUP, 1)
    assert ((packed.dense() - w).abs() <= 0.05 * step + 1e-6).all()
    other = torch.randn(48, 96)  # values on no grid, groups of 96: int8
    assert pack_linear(other, gq=quantize_rtn(other, 96)).kind == "int8"


@pytest.mark.parametrize(
    ("shape", "kind"),
    [
        ((48, 96), "int8"),
        ((40, 64), "int8"),
        ((32, 72), "int8"),  # padded to 80 columns (INT8_COLS)
        ((16, 100), "float32"),
        ((7, 9), "float32"),
    ],
)
def test_other_matrices_fall_back_by_values_and_shape(shape: tuple[int, int], kind: str) -> None:
    """Off any 4-bit grid (or rows % 16): int8 where cols % 8 == 0 (the kernel sums other
    widths wrongly, or crashes), else float32 as loaded."""
    w = torch.randn(*shape)
    if shape == (40, 64):
        w = q4_1(w)  # on a grid, but 40 rows fit no int4 kernel
    packed = pack_linear(w, bias=torch.randn(shape[0]))
    assert packed.kind == kind and int4_grid(w) is None
    x = torch.randn(2, shape[1])
    want = x @ packed.dense().T + packed.bias
    got = packed(x).float()
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max())
    if kind == "int8":  # one step of the row's scale at most, rounding to nearest
        scale = packed.scales.float()[:, None]  # type: ignore[union-attr]
        assert ((packed.dense() - w).abs() <= 0.5 * scale * 1.01).all()


def _packed_logits(
    cfg: ModelConfig, weights: dict[str, torch.Tensor], tokens: torch.Tensor
) -> torch.Tensor:
    """Logits [n, V] the engine's CPU build gives along ``tokens`` (teacher-forced): the
    first from the float32 prefill, as TorchBackend does, the rest one packed step each."""
    model = Transformer(cfg, weights, 64)
    cache = model.new_cache(64)
    step = PackedCpuStep(model, cache)
    rows = [model.forward(tokens[:1], 0, cache)[0]]
    rows += [step.forward_tokens(tokens[p : p + 1], p)[0] for p in range(1, len(tokens))]
    return torch.stack(rows)


def _reference_logits(
    cfg: ModelConfig, weights: dict[str, torch.Tensor], tokens: torch.Tensor
) -> torch.Tensor:
    ref = Transformer(cfg, weights, 64)
    return ref.forward(tokens, 0, ref.new_cache(64))


def _relative(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| per position, over the reference's spread (max - min) there."""
    spread = want.amax(-1) - want.amin(-1)
    return (got - want).abs().amax(-1) / spread


def _weights(name: str, seed: int, logit_scale: float = 1.0) -> dict[str, torch.Tensor]:
    cfg = SMALL[name]
    if name == "int4":
        return q4_1_weights(cfg, seed, logit_scale)
    return random_weights(cfg, dtype=torch.float32, seed=seed, logit_scale=logit_scale)


@pytest.mark.parametrize("name", list(SMALL))
def test_logits_track_the_reference_on_odd_sizes(name: str) -> None:
    cfg, weights = SMALL[name], _weights(name, 3)
    tokens = _prompt(cfg)
    got = _packed_logits(cfg, weights, tokens)
    want = _reference_logits(cfg, dequantized(cfg, weights), tokens)
    assert float(_relative(got[1:], want[1:]).max()) < LOGIT_TOL


@pytest.mark.parametrize("name", list(SMALL))
def test_greedy_picks_match_the_reference_where_decided(name: str) -> None:
    """Along the reference's own greedy path, the packed step picks the reference's token
    wherever the reference's best beats its second by more than DECIDED of the spread."""
    cfg, weights = SMALL[name], _weights(name, 5, logit_scale=8.0)
    ref = ReferenceBackend(cfg, dequantized(cfg, weights), 64, CPU)
    prompt = _prompt(cfg)
    path = torch.cat([prompt, torch.tensor(_greedy(ref, cfg, 24))])
    want = _reference_logits(cfg, dequantized(cfg, weights), path)[len(prompt) - 1 : -1]
    got = _packed_logits(cfg, weights, path)[len(prompt) - 1 : -1]
    top2 = want.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > DECIDED * (want.amax(-1) - want.amin(-1))
    assert int(decided.sum()) >= 12  # most of the 24 steps: the test is not vacuous
    assert torch.equal(got.argmax(-1)[decided], want.argmax(-1)[decided])


def test_the_engines_greedy_stream_matches_the_reference() -> None:
    """End to end (construct_backend, as the engine builds it), int4 layers from Q4_1 grids
    against the float32 reference on the very same weights, until the first near tie."""
    cfg, weights = SMALL["int4"], _weights("int4", 6, logit_scale=8.0)
    backend = construct_backend("torch", cfg, dict(weights), 64, CPU)
    assert isinstance(backend, TorchBackend) and backend.packed is not None
    assert {lw.qkv.kind for lw in backend.packed.layers} == {"int4"}
    assert backend.packed.pick is not None  # greedy tokens from the 4-bit candidates
    want = _greedy(ReferenceBackend(cfg, weights, 64, CPU), cfg, 32)
    prompt = _prompt(cfg)
    logits = _reference_logits(cfg, weights, torch.cat([prompt, torch.tensor(want)]))
    steps = logits[len(prompt) - 1 : -1]
    top2 = steps.topk(2, dim=-1).values
    near = (top2[:, 0] - top2[:, 1]) <= DECIDED * (steps.amax(-1) - steps.amin(-1))
    agree = int(near.nonzero()[0]) if near.any() else len(want)
    assert agree >= 8
    assert _greedy(backend, cfg, 32)[:agree] == want[:agree]


@pytest.mark.slow
def test_the_default_models_shape() -> None:
    """SmolLM2-135M's shape with Q4_1 layer matrices (every layer int4, the head int8):
    logits within LOGIT_TOL of the float32 reference on the same weights."""
    weights = q4_1_weights(REAL, seed=4, logit_scale=1.0)
    model = Transformer(REAL, weights, 8)
    step = PackedCpuStep(model, model.new_cache(8))
    assert {lw.qkv.kind for lw in step.layers} == {"int4"}
    assert step.head is not None and step.head.kind == "int8"
    tokens = _prompt(REAL, 6)
    got = _packed_logits(REAL, weights, tokens)
    want = _reference_logits(REAL, weights, tokens)
    assert float(_relative(got[1:], want[1:]).max()) < LOGIT_TOL
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize(("rows", "cols"), [(4096, 576), (48, 64)])
def test_the_greedy_pick_is_the_float32_heads_best(rows: int, cols: int) -> None:
    """best_row against the float32 product of every row: the same row wherever the best
    beats the second by more than float32 summation noise, though the 4-bit head alone
    ranks another first at some (the rescoring is what picks); fewer rows than PICK too."""
    gen = torch.Generator().manual_seed(9)
    table = torch.randn(rows, cols, generator=gen) * 0.05
    x = torch.randn(256, cols, generator=gen)
    coarse = pack_int4_rtn(table)
    assert coarse is not None and coarse.kind == "int4"
    exact = x @ table.T
    top2 = exact.topk(2, dim=-1).values
    decided = top2[:, 0] - top2[:, 1] > 1e-5 * top2[:, 0].abs()
    assert int(decided.sum()) > 200
    got = best_row(coarse, table, x)
    assert torch.equal(got[decided], exact.argmax(-1)[decided])
    if rows > PICK:
        assert (coarse(x).argmax(-1) != exact.argmax(-1)).any()


def test_no_4bit_head_where_the_shape_fits_no_int4_kernel() -> None:
    assert pack_int4_rtn(torch.randn(97, 64)) is None  # rows % 16
    assert pack_int4_rtn(torch.randn(96, 48)) is None  # cols % 32


def test_a_greedy_step_picks_the_logits_best() -> None:
    """PackedCpuStep.greedy (4-bit candidates) against __call__ (int8 logits, rescored) on the
    same states: the same token wherever the logits decide, the same position advanced."""
    cfg = dataclasses.replace(SMALL["int4"], vocab_size=1024)
    weights = q4_1_weights(cfg, seed=11, logit_scale=8.0)
    model = Transformer(cfg, weights, 64)
    prompt = _prompt(cfg)
    steps = [PackedCpuStep(model, model.new_cache(64)) for _ in range(2)]
    assert steps[0].pick is not None
    for st in steps:
        model.prefill(prompt, st.cache)
        st.pos.fill_(len(prompt))
        st.tok.fill_(int(prompt[-1]))
    decided = 0
    for _ in range(24):
        logits = steps[0]()
        steps[1].greedy()
        assert int(steps[0].pos) == int(steps[1].pos)
        top2 = logits.topk(2).values
        if top2[0] - top2[1] > DECIDED * (logits.max() - logits.min()):
            decided += 1
            assert int(steps[1].tok) == int(steps[0].tok)
        steps[1].tok.copy_(steps[0].tok)  # both go on from the same token
    assert decided >= 12


def _greedy(backend: object, cfg: ModelConfig, n: int) -> list[int]:
    prompt = tuple(_prompt(cfg).tolist())
    req = DecodeRequest(prompt, SamplingParams(temperature=0.0), n, frozenset())
    return list(backend.stream(req, CancelToken()))  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["llama3-tied", "odd"])
def test_several_tokens_at_once_equal_single_steps_bitwise(name: str) -> None:
    """What makes speculation emit exactly what plain decoding does."""
    cfg = SMALL[name]
    model = Transformer(cfg, random_weights(cfg, dtype=torch.float32, seed=7), 32)
    tokens = _prompt(cfg, 9)
    caches = [model.new_cache(32), model.new_cache(32)]
    steps = [PackedCpuStep(model, c) for c in caches]
    for c in caches:
        model.forward(tokens[:3], 0, c)
    together = steps[0].forward_tokens(tokens[3:], 3)
    alone = torch.cat([steps[1].forward_tokens(tokens[p : p + 1], p) for p in range(3, 9)])
    assert torch.equal(together, alone)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


@pytest.mark.parametrize(
    "sp",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=20, seed=3)],
    ids=["greedy", "sampled"],
)
def test_speculation_gives_the_packed_steps_tokens(sp: SamplingParams) -> None:
    cfg = SHAPES["odd"]
    weights = random_weights(cfg, dtype=torch.float32, seed=2)
    gen = torch.Generator().manual_seed(5)
    piece = torch.randint(0, cfg.vocab_size, (30,), generator=gen).tolist()
    request = DecodeRequest(tuple(piece + piece[:20]), sp, 40, frozenset())
    backend = TorchBackend(cfg, weights, 128, CPU, cpu_packed=True)
    plain = list(backend.stream(request, CancelToken()))
    backend.set_speculative(SpeculativeConfig(num_tokens=5, ngram_min=1))
    assert list(backend.stream(request, CancelToken())) == plain
    assert backend.speculation is not None and backend.speculation.drafted > 0


def test_a_bfloat16_engine_runs_packed_too() -> None:
    cfg = CONFIGS["llama3-tied"]
    weights = random_weights(cfg, dtype=torch.bfloat16, seed=5, logit_scale=8.0)
    backend = construct_backend("torch", cfg, weights, 64, CPU)
    assert len(_greedy(backend, cfg, 8)) == 8


def test_auto_on_the_cpu_is_the_packed_torch_engine() -> None:
    assert resolve_engine("auto", CPU) == "torch"
    assert resolve_engine("torch", CPU) == "torch"
    # Built directly, the torch engine keeps the float32 step (the engine tests' oracle).
    cfg = CONFIGS["llama3-tied"]
    assert TorchBackend(cfg, random_weights(cfg, dtype=torch.float32), 16, CPU).packed is None


# SMALL["int4"] with a vocabulary past PICK: the greedy step's 4-bit candidates are a choice.
INT4_HEAD = dataclasses.replace(SMALL["int4"], vocab_size=1024)


def test_a_greedy_pass_picks_what_greedy_steps_pick_bitwise() -> None:
    """greedy_tokens over several positions (a greedy verification pass) against greedy()
    steps one at a time on another cache: the same picks, positions and cache rows."""
    cfg = INT4_HEAD
    model = Transformer(cfg, q4_1_weights(cfg, seed=11, logit_scale=1.0), 32)
    tokens = _prompt(cfg, 11)
    steps = [PackedCpuStep(model, model.new_cache(32)) for _ in range(2)]
    assert steps[0].pick is not None
    for st in steps:
        model.forward(tokens[:3], 0, st.cache)
    together = steps[0].greedy_tokens(tokens[3:], 3)
    alone, st = [], steps[1]
    for p in range(3, len(tokens)):
        st.tok.fill_(int(tokens[p]))
        st.pos.fill_(p)
        st.greedy()
        assert int(st.pos) == p + 1
        alone.append(int(st.tok))
    assert together.tolist() == alone
    assert torch.equal(steps[0].cache.k, steps[1].cache.k)
    assert torch.equal(steps[0].cache.v, steps[1].cache.v)


@pytest.mark.parametrize("t", [2, 5, 9, 33])
def test_the_4bit_heads_candidates_for_several_rows_are_each_rows_own(t: int) -> None:
    """At the default model's head (49,152 x 576): the 4-bit logits, the candidates and
    their float32 scores of T rows at once bitwise those of each row alone, which is what
    lets a greedy verification pass pick as single greedy steps do."""
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(REAL.vocab_size, REAL.hidden_size, generator=gen) * 0.05
    coarse = pack_int4_rtn(table)
    assert coarse is not None
    x = torch.randn(t, REAL.hidden_size, generator=gen)
    top, exact = candidates(coarse(x), table, x, PICK)
    for i in range(t):
        assert torch.equal(coarse(x[i : i + 1])[0], coarse(x)[i])
        top_i, exact_i = candidates(coarse(x[i : i + 1]), table, x[i : i + 1], PICK)
        assert torch.equal(top_i[0], top[i]) and torch.equal(exact_i[0], exact[i])


@pytest.mark.parametrize("never", [True, False], ids=["no-draft-ever", "drafts"])
def test_greedy_speculation_runs_the_plain_greedy_step_and_the_4bit_head(
    never: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's CPU build, greedy: a pass without a draft is its plain greedy step
    (PackedCpuStep.greedy), a pass with one picks from the same 4-bit candidates
    (greedy_tokens), and the int8 logits are never scored. Here the int8 head, which only
    logits read, keeps each weight's sign alone and RESCORE is 1, so a pass that took its
    argmax (as verification did) would soon emit another token than plain decoding."""
    pack_int8 = cpu_packed.pack_int8

    def coarse_int8(w: torch.Tensor, bias: torch.Tensor | None = None) -> cpu_packed.PackedLinear:
        return pack_int8(w.sign(), bias)

    monkeypatch.setattr(cpu_packed, "pack_int8", coarse_int8)
    monkeypatch.setattr(cpu_packed, "RESCORE", 1)
    cfg = INT4_HEAD
    weights = q4_1_weights(cfg, seed=2, logit_scale=1.0)
    gen = torch.Generator().manual_seed(5)
    piece = torch.randint(0, cfg.vocab_size, (30,), generator=gen).tolist()
    prompt = piece[:20] if never else piece + piece[:20]
    request = DecodeRequest(tuple(prompt), SamplingParams(temperature=0.0), 40, frozenset())
    backend = construct_backend("torch", cfg, dict(weights), 128, CPU)
    assert isinstance(backend, TorchBackend) and backend.packed is not None
    packed = backend.packed
    assert packed.pick is not None
    plain = list(backend.stream(request, CancelToken()))
    counts = {}
    for name in ("greedy", "greedy_tokens", "forward_tokens", "_logits"):
        counts[name] = Counted(getattr(packed, name))
        monkeypatch.setattr(packed, name, counts[name])
    never_cfg = SpeculativeConfig(num_tokens=4, ngram_min=64, ngram_max=64)
    backend.set_speculative(never_cfg if never else SpeculativeConfig(num_tokens=4, ngram_min=1))
    assert list(backend.stream(request, CancelToken())) == plain
    stats = backend.speculation
    assert stats is not None
    draftless = len(plain) - 1 - stats.accepted - stats.passes
    assert counts["forward_tokens"].calls == 0 and counts["_logits"].calls == 0
    # greedy() runs its picks through greedy_tokens too: one call each.
    assert counts["greedy"].calls == draftless
    assert counts["greedy_tokens"].calls == draftless + stats.passes
    if never:
        assert stats.passes == 0
    else:
        assert stats.passes > 0 and stats.accepted > 0 and draftless > 0
        # Not vacuous: along this path the int8 logits' argmax differs from the greedy pick.
        path = torch.tensor(list(prompt) + plain[:-1])
        ref = Transformer(cfg, weights, 128)
        probe = PackedCpuStep(ref, ref.new_cache(128))
        ref.prefill(path[: len(prompt)], probe.cache)
        tail = path[len(prompt) - 1 :]
        int8_picks = probe.forward_tokens(tail[1:], len(prompt)).argmax(-1)
        assert int8_picks.tolist() != plain[1:]


def test_sampled_speculation_runs_the_plain_step_without_drafts() -> None:
    """Sampled, on the engine's CPU build: each pass without a draft is the plain packed step
    (``__call__``, the logits the sampling reads), and the ids are those without drafts."""
    cfg = INT4_HEAD
    weights = q4_1_weights(cfg, seed=2, logit_scale=1.0)
    sp = SamplingParams(temperature=0.9, top_k=20, seed=3)
    request = DecodeRequest(tuple(_prompt(cfg, 20).tolist()), sp, 30, frozenset())
    backend = construct_backend("torch", cfg, dict(weights), 128, CPU)
    assert isinstance(backend, TorchBackend)
    plain = list(backend.stream(request, CancelToken()))
    step = backend._step = Counted(backend._step)  # type: ignore[method-assign]
    backend.set_speculative(SpeculativeConfig(num_tokens=4, ngram_min=64, ngram_max=64))
    assert list(backend.stream(request, CancelToken())) == plain
    assert step.calls == len(plain) - 1
