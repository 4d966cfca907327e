"""The result document of ``monokernel bench``: one record per (engine, prompt, gen) cell.

Schema (``SCHEMA_VERSION`` 2; version 1 was the single-cell format before sweeps, which had
no ``schema_version`` field)::

    {schema_version, kind: "monokernel-bench",
     environment: {device, gpu: {name, driver, sm_clock_mhz, ...} | null, python, os, torch,
                   cuda, transformers, monokernel},
     model: {label, family, parameters, max_context, dtype, weight_bytes_per_token},
     runs: [{args, started_utc, copy_bw_GBps | null, gpu_clocks}],   # one per bench process
     cells: [{run, engine, prompt_tokens, turn_tokens, gen_tokens, status: "ok" | "error",
              ...}],
     skipped: [{run, engine | null, prompt_tokens, turn_tokens, gen_tokens, reason}]}

``turn_tokens`` (``--turn-tokens``): 0 when every timed request is a fresh random prompt of
``prompt_tokens``; N > 0 when the cell measures an agent's next turn, every timed request
being the warm-up's ``prompt_tokens``-token prompt plus N new tokens (``bench/sweep.py``).
It and ``request_prompt_tokens`` were added within version 2: results written before them
lack both, so read a missing ``turn_tokens`` as 0.

An ``ok`` cell holds ``request_prompt_tokens`` (the length of each timed request's prompt,
``prompt_tokens + turn_tokens``), ``gen_tokens_run`` (fewer than ``gen_tokens`` when the
engine is capped), ``repeats``, ``runs_raw`` (every timed request: ``ttft_ms``,
``us_per_token``, ``tokens``, and ``reused_tokens`` where the engine has a prefix cache that
tells, i.e. monokernel: prompt tokens taken from its cache instead of prefilled),
``us_per_token``/``tok_per_s``/``ttft_ms`` as ``{median, p10, p90}``, ``mean_context``
(``request_prompt_tokens + gen_tokens_run / 2``), ``bytes_per_token`` at that context,
``cache_positions`` (what the engine allocated: the cell's need, or ``--context``), ``tp``
(the GPUs of a ``@tpN`` engine, 1 otherwise; both added within version 2), and when the run
measured a copy bandwidth ``copy_bw_GBps``, ``floor_us``, ``roofline_tok_s`` and ``mbu``
(against N times the bandwidth at ``tp`` N); ``vs_torch`` and ``ttft_vs_torch`` compare
with the torch engine's cell of the same run, prompt, turn and gen (None without one).
Every cell has ``cell_wall_s`` (the whole cell: open, warm-up, timed requests, close), and
engines add their own fields (``hf_cache``,
``endpoint_model``, ``stage_profile_us``, and monokernel's ``handoff_search``: ``us_per_step``
of each place its load-time search timed, the one ``chosen`` and the ``spans`` of positions
timed; records written before the spans have ``start_pos`` and ``steps`` instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from monokernel.bench.measure import RunTiming, bytes_per_token, engine_tp, split_engine
from monokernel.bench.stats import summarize
from monokernel.models.config import ModelConfig

SCHEMA_VERSION = 2
KIND = "monokernel-bench"


def model_info(cfg: ModelConfig, label: str, dtype: str, weight_bytes: int) -> dict[str, Any]:
    return {
        "label": label,
        "family": cfg.family,
        "parameters": cfg.num_parameters(),
        "max_context": cfg.max_position_embeddings,
        "dtype": dtype,
        "weight_bytes_per_token": bytes_per_token(cfg, 0, weight_bytes),
    }


def new_document(environment: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": KIND,
        "environment": environment,
        "model": model,
        "runs": [],
        "cells": [],
        "skipped": [],
    }


def prompt_label(prompt_tokens: int, turn_tokens: int = 0) -> str:
    """``16384+500`` for a turn cell (base prompt + new tokens), else ``16384``."""
    return f"{prompt_tokens}+{turn_tokens}" if turn_tokens else str(prompt_tokens)


def _raw(t: RunTiming) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "ttft_ms": t.ttft_s * 1e3,
        "us_per_token": t.decode_s_per_token * 1e6,
        "tokens": t.tokens,
    }
    if t.reused_tokens is not None:
        raw["reused_tokens"] = t.reused_tokens
    return raw


def ok_record(
    engine: str,
    prompt_tokens: int,
    gen_tokens: int,
    timings: Sequence[RunTiming],
    cfg: ModelConfig,
    bandwidth: float | None,
    weight_bytes: int,
    turn_tokens: int = 0,
) -> dict[str, Any]:
    """Statistics of the timed requests of one cell, and where they sit against the roofline.

    MBU = bytes a decode step must read at the mean context of the timed tokens / measured
    time per token / the copy bandwidth measured in the same run (times the GPUs of a
    ``@tpN`` engine: their bytes split over N GPUs). The context is the
    request's whole prompt (base + turn): decode attends to all of it, reused or not."""
    gen_run = timings[0].tokens
    us = [t.decode_s_per_token * 1e6 for t in timings]
    median_us = summarize(us)["median"]
    request_prompt = prompt_tokens + turn_tokens
    context = request_prompt + gen_run / 2
    bpt = bytes_per_token(cfg, context, weight_bytes, split_engine(engine)[1])
    tp = engine_tp(engine)  # the bytes split over tp GPUs, each streaming at ``bandwidth``
    if bandwidth:
        bandwidth *= tp
    rec: dict[str, Any] = {
        "engine": engine,
        "tp": tp,
        "prompt_tokens": prompt_tokens,
        "turn_tokens": turn_tokens,
        "request_prompt_tokens": request_prompt,
        "gen_tokens": gen_tokens,
        "status": "ok",
        "gen_tokens_run": gen_run,
        "repeats": len(timings),
        "runs_raw": [_raw(t) for t in timings],
        "us_per_token": summarize(us),
        "tok_per_s": summarize([1e6 / u for u in us]) if min(us) > 0 else None,
        "ttft_ms": summarize([t.ttft_s * 1e3 for t in timings]),
        "mean_context": context,
        "bytes_per_token": bpt,
        "copy_bw_GBps": None,
        "floor_us": None,
        "roofline_tok_s": None,
        "mbu": None,
    }
    if bandwidth:
        rec |= {
            "copy_bw_GBps": bandwidth / 1e9,
            "floor_us": bpt / bandwidth * 1e6,
            "roofline_tok_s": bandwidth / bpt,
            "mbu": bpt / (median_us * 1e-6) / bandwidth if median_us > 0 else None,
        }
    return rec


def error_record(
    engine: str, prompt_tokens: int, gen_tokens: int, exc: BaseException, turn_tokens: int = 0
) -> dict:
    return {
        "engine": engine,
        "prompt_tokens": prompt_tokens,
        "turn_tokens": turn_tokens,
        "gen_tokens": gen_tokens,
        "status": "error",
        "error": f"{type(exc).__name__}: {exc}"[:2000],
    }


def _cell_key(c: dict[str, Any]) -> tuple[int, int, int, int]:
    return c["run"], c["prompt_tokens"], c.get("turn_tokens", 0), c["gen_tokens"]


def add_torch_ratios(cells: list[dict[str, Any]]) -> None:
    """``vs_torch`` = torch's µs/token / this engine's (> 1: faster than torch), and the same
    for TTFT, against the torch cell of the same run, prompt, turn and gen."""
    torch_cells = {_cell_key(c): c for c in cells if c["engine"] == "torch" and c["status"] == "ok"}
    for c in cells:
        if c["status"] != "ok":
            continue
        ref = torch_cells.get(_cell_key(c))
        us, ttft = c["us_per_token"]["median"], c["ttft_ms"]["median"]
        c["vs_torch"] = ref["us_per_token"]["median"] / us if ref and us > 0 else None
        c["ttft_vs_torch"] = ref["ttft_ms"]["median"] / ttft if ref and ttft > 0 else None


_CELL_KEYS = ("run", "engine", "prompt_tokens", "gen_tokens", "status")
_OK_KEYS = ("gen_tokens_run", "repeats", "runs_raw", "us_per_token", "tok_per_s", "ttft_ms")
_OK_KEYS += ("mean_context", "bytes_per_token", "mbu", "roofline_tok_s", "vs_torch")


def validate(doc: Any) -> dict[str, Any]:
    """``doc`` if it is a bench result this code can read; ValueError naming what is off."""
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise ValueError("not a monokernel bench result (no kind: monokernel-bench)")
    version = doc.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(f"schema_version {version!r}; this code reads {SCHEMA_VERSION}")
    for key in ("environment", "model", "runs", "cells", "skipped"):
        if key not in doc:
            raise ValueError(f"result has no {key!r}")
    for i, c in enumerate(doc["cells"]):
        need = _CELL_KEYS + (_OK_KEYS if c.get("status") == "ok" else ("error",))
        missing = [k for k in need if k not in c]
        if missing:
            raise ValueError(f"cell {i} ({c.get('engine')}) lacks {', '.join(missing)}")
        if not 0 <= c["run"] < len(doc["runs"]):
            raise ValueError(f"cell {i} names run {c['run']}, which the result does not hold")
    return doc
