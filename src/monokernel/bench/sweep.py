"""The sweep: every engine at every (prompt, gen) cell, in one process, into one document.

Cells run in order of prompt, then gen, and within a cell engine after engine, so whatever
part of a long sweep finishes (a time budget, a kill) already holds side-by-side numbers.
Each engine is opened for the cell, warmed up once (build, compile, graph capture: never
timed), timed ``repeats`` times on fresh random prompts of the cell's length, and closed.
Fresh prompts per request keep a server's prefix cache from answering a repeat.

With ``turn_tokens`` N > 0 a cell measures an agent's next turn instead: the warm-up runs a
base prompt of the cell's length and every timed request is that base plus N fresh tokens,
so an engine with a prefix cache (monokernel) prefills only the N new tokens while the
others recompute the whole prompt (``_time_cell`` says how every repeat sees the same cache).
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from monokernel.bench import records
from monokernel.bench.engines import (
    EngineOptions,
    LayerStream,
    Runner,
    WeightSource,
    open_runner,
    release,
)
from monokernel.bench.environment import environment, gpu_info
from monokernel.bench.measure import RunTiming, copy_bandwidth
from monokernel.models.config import ModelConfig

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What a slow or bounded engine is spared. None: no limit."""

    max_prompt: int | None = None  # skip cells with a longer prompt
    max_gen: int | None = None  # skip cells that generate more
    gen_cap: int | None = None  # time only this many tokens (the decode rate from fewer)
    repeats: int | None = None  # at most this many timed requests


@dataclass(frozen=True, slots=True)
class SweepConfig:
    engines: tuple[str, ...]
    prompt_tokens: tuple[int, ...]
    gen_tokens: tuple[int, ...]
    repeats: int = 3
    warmup_tokens: int = 32  # the untimed first request (HF with a static cache: full length)
    seed: int = 0
    profile: bool = False  # monokernel: per-stage times of one step
    limits: Mapping[str, EngineLimits] = field(default_factory=dict)
    time_budget_s: float | None = None  # start no engine/cell after this many seconds
    options: EngineOptions = field(default_factory=EngineOptions)
    turn_tokens: int = 0  # > 0: each timed request is the warm-up's prompt + this many tokens
    context: int = 0  # cache positions every engine allocates; 0: what each cell needs

    def __post_init__(self) -> None:
        if not self.engines or not self.prompt_tokens or not self.gen_tokens:
            raise ValueError("a sweep needs at least one engine, prompt length and gen length")
        if min(self.prompt_tokens) < 1:
            raise ValueError("prompt lengths must be >= 1")
        if min(self.gen_tokens) < 2:
            raise ValueError("gen lengths must be >= 2 (a decode rate needs two tokens)")
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")
        if self.turn_tokens < 0:
            raise ValueError("turn tokens must be >= 0 (0: a fresh prompt per request)")
        if self.context < 0:
            raise ValueError("context must be >= 0 (0: what each cell needs)")


def plan_cells(
    sweep: SweepConfig, max_context: int
) -> tuple[list[tuple[int, int]], list[dict[str, Any]]]:
    """The (prompt, gen) cells that fit the model's context (prompt, turn and gen together),
    and a note for each that does not."""
    cells, skipped = [], []
    for p in sorted(set(sweep.prompt_tokens)):
        for g in sorted(set(sweep.gen_tokens)):
            if p + sweep.turn_tokens + g > max_context:
                reason = f"over the model's max context ({max_context})"
                skipped.append(_note(None, p, sweep.turn_tokens, g) | {"reason": reason})
            else:
                cells.append((p, g))
    return cells, skipped


def _note(engine: str | None, prompt: int, turn: int, gen: int) -> dict[str, Any]:
    """The identifying fields of a skip note (records.py)."""
    return {"engine": engine, "prompt_tokens": prompt, "turn_tokens": turn, "gen_tokens": gen}


def make_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


def _limit_reason(limits: EngineLimits, prompt: int, gen: int) -> str | None:
    if limits.max_prompt is not None and prompt > limits.max_prompt:
        return f"prompt over this engine's limit ({limits.max_prompt})"
    if limits.max_gen is not None and gen > limits.max_gen:
        return f"gen over this engine's limit ({limits.max_gen})"
    return None


def cell_prompts(
    sweep: SweepConfig, vocab: int, prompt_len: int, gen_run: int, repeats: int
) -> tuple[list[int], list[list[int]]]:
    """The warm-up (base) prompt of a cell and its timed prompts, the same for every engine:
    fresh random prompts of ``prompt_len`` tokens, or with ``turn_tokens`` N the base plus N
    fresh tokens (an agent's next turn)."""
    seed = sweep.seed * 1_000_003 + prompt_len * 7919 + gen_run
    base = make_prompt(vocab, prompt_len, seed)
    turn = sweep.turn_tokens
    if turn:
        return base, [base + make_prompt(vocab, turn, seed + 1 + i) for i in range(repeats)]
    return base, [make_prompt(vocab, prompt_len, seed + 1 + i) for i in range(repeats)]


def _warm_up(runner: Runner, sweep: SweepConfig, base: list[int], gen_run: int) -> None:
    warmup = getattr(runner, "warmup", None)
    if warmup is not None:
        # A runner's own warm-up sizes static buffers for what it runs (HF's static cache);
        # the timed prompts are turn_tokens longer than the base.
        warmup(base, gen_run, sweep.turn_tokens)
    else:
        runner.run(base, min(gen_run, sweep.warmup_tokens))


def _time_cell(
    runner: Runner, sweep: SweepConfig, vocab: int, prompt_len: int, gen_run: int, repeats: int
) -> list[RunTiming]:
    turns = bool(sweep.turn_tokens)
    base, prompts = cell_prompts(sweep, vocab, prompt_len, gen_run, repeats + turns)
    _warm_up(runner, sweep, base, gen_run)
    if turns:
        # One turn untimed first: whatever a turn builds on first use (the monokernel's
        # prefill graph for a suffix at a later start) is built here, not in a timed turn.
        runner.run(prompts.pop(), min(gen_run, sweep.warmup_tokens))
        runner.run(base, min(gen_run, sweep.warmup_tokens))
    timings: list[RunTiming] = []
    for i, prompt in enumerate(prompts):
        if sweep.turn_tokens and i > 0:
            # Every turn must find the cache as the first one did. A turn leaves base + its
            # own tokens in the monokernel's live cache; the next turn shares only the base
            # with it, so before prefilling it would copy that conversation aside as a
            # snapshot (runtime/prefix_cache.py: when a request overwrites >= 128 tracked
            # tokens) inside its TTFT, which the first turn never paid. The base itself is
            # never lost (every turn keeps cache positions [0, P)). Re-running the base,
            # untimed, takes that copy outside the timing and leaves the base plus fewer
            # than warmup_tokens generated tokens (too few for a snapshot), exactly as the
            # warm-up did: each turn reuses the P base tokens and prefills only its own.
            # Engines without a prefix cache just run one more untimed request.
            runner.run(base, min(gen_run, sweep.warmup_tokens))
        timings.append(runner.run(prompt, gen_run))
    return timings


def _check_reuse(rec: dict[str, Any], log: Log) -> None:
    """Say so when a turn cell's engine reports reusing less than the base prompt: then its
    TTFT is not the prefix-reuse TTFT the cell stands for."""
    reused = [r["reused_tokens"] for r in rec["runs_raw"] if "reused_tokens" in r]
    if rec["turn_tokens"] and reused and min(reused) < rec["prompt_tokens"]:
        log(
            f"    note: {rec['engine']} reused only {min(reused)} of the {rec['prompt_tokens']} "
            "base tokens in a timed request"
        )


def _measure_cell(
    name: str,
    cfg: ModelConfig,
    weights: WeightSource | None,
    sweep: SweepConfig,
    device: torch.device,
    bandwidth: float | None,
    weight_bytes: int,
    cell: tuple[int, int, int, int],  # prompt, gen, gen actually timed, repeats
    log: Log,
) -> dict[str, Any]:
    """Open ``name`` for one cell, time it, close it: its record, ok or error."""
    prompt_len, gen, gen_run, repeats = cell
    turn = sweep.turn_tokens
    runner: Runner | None = None
    start = time.perf_counter()
    try:
        max_len = max(prompt_len + turn + gen + 1, sweep.context)
        runner = open_runner(name, cfg, weights, max_len, device, sweep.options)
        timings = _time_cell(runner, sweep, cfg.vocab_size, prompt_len, gen_run, repeats)
        rec = records.ok_record(
            name, prompt_len, gen, timings, cfg, bandwidth, weight_bytes, turn_tokens=turn
        )
        layers: LayerStream | None = getattr(runner, "layers", None)
        if layers is not None:
            _count_streamed(rec, layers.bytes_per_token(cfg, rec["mean_context"], weight_bytes))
        rec |= getattr(runner, "info", None) or {}
        rec["cache_positions"] = max_len
        profile = getattr(runner, "profile", None)
        if sweep.profile and profile is not None:
            # At the timed requests' prompt length, so the profile's context is the record's.
            stages = profile(make_prompt(cfg.vocab_size, prompt_len + turn, sweep.seed), gen_run)
            if stages:
                rec["stage_profile_us"] = stages
        us, ttft = rec["us_per_token"]["median"], rec["ttft_ms"]["median"]
        log(f"    {us:.1f} µs/token, TTFT {ttft:.2f} ms ({time.perf_counter() - start:.1f} s)")
        _check_reuse(rec, log)
    except Exception as exc:  # one engine failing must not hide the others' numbers
        rec = records.error_record(name, prompt_len, gen, exc, turn_tokens=turn)
        log(f"    error: {rec['error']}")
    finally:
        try:
            release(runner, device)
        except Exception as exc:  # a failed close must not stop the sweep either
            log(f"    error closing {name}: {type(exc).__name__}: {exc}")
    # Wall time of the whole cell (open, warm-up and compile, timed requests, close): what
    # a time budget has to plan for.
    rec["cell_wall_s"] = time.perf_counter() - start
    return rec


def _count_streamed(rec: dict[str, Any], bpt: float) -> None:
    """``rec``'s bytes per token and roofline as ok_record counts them, from the bytes the
    engine streams: the monokernel's layers as it packed them (a checkpoint's own groups,
    its FP8 blocks), which its label alone does not tell."""
    rec["bytes_per_token"] = bpt
    if rec["copy_bw_GBps"]:
        bandwidth = rec["copy_bw_GBps"] * 1e9  # ok_record's: already times the GPUs
        median_us = rec["us_per_token"]["median"]
        rec |= {
            "floor_us": bpt / bandwidth * 1e6,
            "roofline_tok_s": bandwidth / bpt,
            "mbu": bpt / (median_us * 1e-6) / bandwidth if median_us > 0 else None,
        }


def run_sweep(
    cfg: ModelConfig,
    weights: WeightSource | None,
    sweep: SweepConfig,
    device: torch.device,
    bandwidth: float | None,
    run_index: int = 0,
    weight_bytes: int = 2,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    log: Log = _stderr,
    on_skip: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Time every engine at every cell; returns (cell records, skipped notes). The
    callbacks see each record and each skip note as soon as it exists."""
    cells, planned = plan_cells(sweep, cfg.max_position_embeddings)
    skipped: list[dict[str, Any]] = []

    def skip(note: dict[str, Any]) -> None:
        note = {"run": run_index} | note
        skipped.append(note)
        if on_skip is not None:
            on_skip(note)

    label = functools.partial(records.prompt_label, turn_tokens=sweep.turn_tokens)
    for s in planned:
        log(
            f"note: skipped prompt {label(s['prompt_tokens'])} gen {s['gen_tokens']}: {s['reason']}"
        )
        skip(s)
    out: list[dict[str, Any]] = []
    start = time.perf_counter()
    total = len(cells) * len(sweep.engines)
    done = 0
    for prompt_len, gen in cells:
        for name in sweep.engines:
            done += 1
            limits = sweep.limits.get(name, EngineLimits())
            reason = _limit_reason(limits, prompt_len, gen)
            elapsed = time.perf_counter() - start
            if reason is None and sweep.time_budget_s is not None and elapsed > sweep.time_budget_s:
                reason = f"time budget ({sweep.time_budget_s:.0f} s) spent"
            if reason is not None:
                skip(_note(name, prompt_len, sweep.turn_tokens, gen) | {"reason": reason})
                log(f"note: skipped {name} at prompt {label(prompt_len)} gen {gen}: {reason}")
                continue
            gen_run = min(gen, limits.gen_cap) if limits.gen_cap else gen
            repeats = min(sweep.repeats, limits.repeats) if limits.repeats else sweep.repeats
            log(f"[{done}/{total}] {name} prompt {label(prompt_len)} gen {gen_run} x{repeats} ...")
            rec = _measure_cell(
                name, cfg, weights, sweep, device, bandwidth, weight_bytes,
                (prompt_len, gen, gen_run, repeats), log,
            )  # fmt: skip
            rec = {"run": run_index} | rec
            out.append(rec)
            if on_record is not None:
                on_record(rec)
    return out, skipped


def write_json(doc: dict[str, Any], path: str | Path) -> None:
    """Atomically, so a sweep killed mid-write leaves the previous complete file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    os.replace(tmp, path)


def run_benchmark(
    cfg: ModelConfig,
    weights: WeightSource | None,
    label: str,
    sweep: SweepConfig,
    device: torch.device,
    args: dict[str, Any],
    dtype: torch.dtype = torch.bfloat16,
    json_path: str | Path | None = None,
    log: Log = _stderr,
) -> dict[str, Any]:
    """One bench process: bandwidth, environment, the sweep; the result document.

    With ``json_path`` the document is rewritten after every cell, so a run cut short still
    leaves every finished cell on disk."""
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    weight_bytes = torch.empty((), dtype=dtype).element_size()
    env = environment(device)  # after the copy test: clocks read on a busy GPU
    doc = records.new_document(env, records.model_info(cfg, label, str(dtype), weight_bytes))
    doc["runs"].append(
        {
            "args": args,
            "started_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "copy_bw_GBps": bandwidth / 1e9 if bandwidth else None,
            "gpu_clocks": _clocks(env),
        }
    )

    def on_record(rec: dict[str, Any]) -> None:
        doc["cells"].append(rec)
        records.add_torch_ratios(doc["cells"])
        if json_path:
            write_json(doc, json_path)

    def on_skip(note: dict[str, Any]) -> None:
        doc["skipped"].append(note)

    # Records and notes arrive through the callbacks, so a run cut short keeps them on disk.
    run_sweep(cfg, weights, sweep, device, bandwidth, 0, weight_bytes, on_record, log, on_skip)
    if device.type == "cuda":
        doc["runs"][0]["gpu_clocks_after"] = _clocks({"gpu": gpu_info(device)})
    if json_path:
        write_json(doc, json_path)
    return doc


def _clocks(env: dict[str, Any]) -> dict[str, Any] | None:
    gpu = env.get("gpu")
    if not gpu:
        return None
    keys = ("sm_clock_mhz", "max_sm_clock_mhz", "mem_clock_mhz", "pstate", "clock_source")
    return {k: gpu.get(k) for k in keys}
