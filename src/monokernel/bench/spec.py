"""``monokernel bench --workload``: n-gram speculative decoding on agent-shaped prompts
(issue 36).

Each engine (``torch``, ``reference``, ``monokernel``: the backends that verify drafts; the
monokernel's in its pass build, docs/speculative.md) is opened once, on
the checkpoint's weights, with a cache for the longest request of the chosen workloads
(workloads/spec_workloads.py). Every request of every workload then runs greedy, to the
model's EOS or the workload's token cap, once without drafts and once per K of
``--num-speculative-tokens`` with ``--speculative ngram``, on that one backend (the
modes interleaved, ``--repeats`` times). A record per (engine, workload, K; K 0 = without):

- decode tok/s: (tokens - 1) / (first token -> last token), summed over the workload's
  requests, median over the repeats, and ``vs_off``, its ratio to the same engine without
  drafts;
- ``drafted``, ``accepted``, ``verify_passes`` (passes that carried a draft),
  ``accepted_per_pass`` = accepted / verify_passes, and ``tokens_per_pass`` (the acceptance
  length: tokens emitted per decode forward pass, draftless passes included;
  1.0 without drafts);
- ``identical``: whether every run gave token for token the first run without drafts
  (greedy with and without drafts must agree; repeats must too), and where it first did not;
- ``copied_lines``: how much of the file or log the answer re-emitted, and
  ``self_repeat``: the share of its tokens that close an 8-gram the answer itself already
  held, since a small model may loop on its own words, which drafts accept as well as a
  copy of the prompt (a copy of the prompt scores near 0 there, a loop near 1).

A mismatch is printed after the table as a ``MISMATCH`` line (and on stderr), and the
command exits 1. Timings here are the bench's only: no test asserts one.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from monokernel.bench.measure import split_engine, time_tokens
from monokernel.bench.stats import summarize
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.sampling import SamplingParams
from monokernel.runtime.speculative import SpeculationStats, SpeculativeConfig
from monokernel.workloads.spec_workloads import SpecWorkload, copied_lines

if TYPE_CHECKING:
    from monokernel.weights.loader import Checkpoint

KIND = "monokernel-bench-spec"
SCHEMA_VERSION = 1
# Our backends that verify drafts (runtime/speculative.py; the monokernel's in its pass build).
ENGINES = ("torch", "reference", "monokernel")

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class SpecBackend(Protocol):
    """What the bench needs of a backend: our Backend with the Speculating mixin."""

    speculation: SpeculationStats | None

    def set_speculative(self, config: SpeculativeConfig | None) -> None: ...

    def stream(self, request: DecodeRequest, cancel: CancelToken) -> Iterator[int]: ...

    def close(self) -> None: ...


class TextCodec(Protocol):
    """What the bench needs of a tokenizer (tokenizer.Tokenizer is one)."""

    def encode_prompt(self, prompt: list[dict[str, str]]) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class SpecBenchConfig:
    engines: tuple[str, ...]
    workloads: tuple[SpecWorkload, ...]
    ks: tuple[int, ...]  # the --num-speculative-tokens values, each against no drafts
    repeats: int = 1
    max_tokens: int | None = None  # a cap for every request; None: each workload's own
    # The drafts' n-gram bounds; None: each engine's default (SpeculativeConfig.bounds).
    ngram_max: int | None = None
    ngram_min: int | None = None
    context: int = 0  # cache positions to allocate; 0: what the longest request needs
    warmup_tokens: int = 32  # the untimed requests first (torch.compile, graph capture)
    time_budget_s: float | None = None  # start no (engine, workload) after this long
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)  # the model's EOS

    def __post_init__(self) -> None:
        if not self.engines or not self.workloads or not self.ks:
            raise ValueError("needs at least one engine, workload and K")
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")
        if self.max_tokens is not None and self.max_tokens < 2:
            raise ValueError("max tokens must be >= 2 (a decode rate needs two tokens)")
        for engine in self.engines:  # SpeculativeConfig's own bounds, with its message
            for k in self.ks:
                SpeculativeConfig("ngram", k, self.ngram_max, self.ngram_min).bounds(
                    split_engine(engine)[0]
                )

    def speculative(self, k: int) -> SpeculativeConfig | None:
        """The drafts' config for K = ``k`` (None for 0: no drafts); each backend takes its
        own n-gram bounds where none is set (SpeculativeConfig.bounds)."""
        return None if k == 0 else SpeculativeConfig("ngram", k, self.ngram_max, self.ngram_min)

    def gen_cap(self, workload: SpecWorkload) -> int:
        return self.max_tokens if self.max_tokens is not None else workload.max_tokens


@dataclass(frozen=True, slots=True)
class RequestRun:
    """One greedy request: its ids, timings and, with drafts, the backend's counts."""

    ids: tuple[int, ...]
    ttft_s: float
    decode_s: float  # first token -> last token
    drafted: int = 0
    accepted: int = 0
    verify_passes: int = 0  # passes that carried a draft

    @property
    def forward_passes(self) -> int:
        """Decode forward passes after the prefill: each emits one token plus the drafted
        tokens it accepted (speculative_stream), so tokens - 1 = passes + accepted."""
        return max(len(self.ids) - 1 - self.accepted, 0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": len(self.ids),
            "ttft_ms": self.ttft_s * 1e3,
            "decode_s": self.decode_s,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "verify_passes": self.verify_passes,
        }


def _collect(tokens: Iterable[int], into: list[int]) -> Iterator[int]:
    for t in tokens:
        into.append(t)
        yield t


def run_request(
    backend: SpecBackend,
    prompt: Sequence[int],
    max_tokens: int,
    stop_token_ids: frozenset[int],
    speculative: SpeculativeConfig | None,
) -> RequestRun:
    """One timed greedy request, with drafts when ``speculative`` is set."""
    backend.set_speculative(speculative)
    request = DecodeRequest(
        tuple(prompt), SamplingParams(temperature=0.0), max_tokens, stop_token_ids
    )
    ids: list[int] = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    timing = time_tokens(_collect(backend.stream(request, CancelToken()), ids), t0)
    stats = backend.speculation if speculative is not None else None
    if stats is None:
        return RequestRun(tuple(ids), timing.ttft_s, timing.decode_s_per_token * (len(ids) - 1))
    return RequestRun(
        tuple(ids),
        timing.ttft_s,
        timing.decode_s_per_token * (len(ids) - 1),
        stats.drafted,
        stats.accepted,
        stats.passes,
    )


def first_mismatch(expected: Sequence[int], got: Sequence[int]) -> int | None:
    """The first position where ``got`` differs from ``expected`` (a length difference
    counts, at the shorter one's end); None when they are the same ids."""
    for i, (a, b) in enumerate(zip(expected, got, strict=False)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def _mismatch(
    expected: Sequence[Sequence[int]], runs: Sequence[Sequence[RequestRun]]
) -> dict[str, Any] | None:
    """Where the first of ``runs`` (repeats x requests) differs from ``expected``."""
    for rep, reqs in enumerate(runs):
        for i, (want, run) in enumerate(zip(expected, reqs, strict=True)):
            at = first_mismatch(want, run.ids)
            if at is not None:
                return {
                    "repeat": rep,
                    "request": i,
                    "index": at,
                    "expected": want[at] if at < len(want) else None,
                    "got": run.ids[at] if at < len(run.ids) else None,
                    "expected_tokens": len(want),
                    "got_tokens": len(run.ids),
                }
    return None


SELF_REPEAT_N = 8  # long enough that ordinary prose and code rarely repeat one


def self_repeat(outputs: Sequence[Sequence[int]], n: int = SELF_REPEAT_N) -> float | None:
    """The share of output tokens (past each output's first n - 1) whose n-gram ending there
    occurred earlier in the same output; None when no output is that long."""
    repeated = total = 0
    for ids in outputs:
        seen: set[tuple[int, ...]] = set()
        for end in range(n, len(ids) + 1):
            gram = tuple(ids[end - n : end])
            repeated += gram in seen
            seen.add(gram)
            total += 1
    return repeated / total if total else None


def _decode_rate(reqs: Sequence[RequestRun]) -> float:
    steps = sum(len(r.ids) - 1 for r in reqs)
    seconds = sum(r.decode_s for r in reqs)
    return steps / seconds if steps > 0 and seconds > 0 else 0.0


def make_record(
    engine: str,
    workload: SpecWorkload,
    k: int,
    config: SpecBenchConfig,
    prompts: Sequence[Sequence[int]],
    runs: Sequence[Sequence[RequestRun]],
    expected: Sequence[Sequence[int]],
    codec: TextCodec,
) -> dict[str, Any]:
    """The record of one (engine, workload, K) from its ``runs`` (repeats x requests);
    ``expected``: each request's ids in the first run without drafts."""
    first = runs[0]
    generated = sum(len(r.ids) for r in first)
    drafted = sum(r.drafted for r in first)
    accepted = sum(r.accepted for r in first)
    verify = sum(r.verify_passes for r in first)
    passes = sum(r.forward_passes for r in first)
    rates = [_decode_rate(reqs) for reqs in runs]
    texts = [codec.decode(r.ids) for r in first]
    copied = None
    if workload.copy_text is not None:
        found = [copied_lines(t, workload.copy_text) for t in texts]
        copied = [sum(f for f, _ in found), sum(n for _, n in found)]
    mismatch = _mismatch(expected, runs)
    spec = config.speculative(k)
    described: dict[str, Any] | None = None
    if spec is not None:
        longest, shortest = spec.bounds(split_engine(engine)[0])
        described = {
            "method": spec.method,
            "num_tokens": spec.num_tokens,
            "ngram_max": longest,
            "ngram_min": shortest,
        }
    rec: dict[str, Any] = {
        "engine": engine,
        "workload": workload.name,
        "k": k,
        "speculative": described,
        "status": "ok",
        "requests": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "max_tokens": config.gen_cap(workload),
        "generated_tokens": generated,
        "finish": [
            "stop" if r.ids and r.ids[-1] in config.stop_token_ids else "length" for r in first
        ],
        "repeats": len(runs),
        "decode_tok_s": summarize(rates),
        "ttft_ms": summarize([sum(r.ttft_s for r in reqs) * 1e3 / len(reqs) for reqs in runs]),
        "drafted": drafted,
        "accepted": accepted,
        "verify_passes": verify,
        "forward_passes": passes,
        "accepted_per_pass": accepted / verify if verify else None,
        "tokens_per_pass": (generated - len(first)) / passes if passes else None,
        "identical": mismatch is None,
        "mismatch": mismatch,
        "copied_lines": copied,
        "self_repeat": self_repeat([r.ids for r in first]),
        "runs_raw": [[r.as_dict() for r in reqs] for reqs in runs],
        "vs_off": None,
    }
    if k == 0:
        rec["outputs"] = texts  # what the model wrote, to read next to its acceptance
    return rec


def add_ratios(records: list[dict[str, Any]]) -> None:
    """``vs_off`` = decode tok/s / the same engine's and workload's without drafts."""
    off = {
        (r["engine"], r["workload"]): r["decode_tok_s"]["median"]
        for r in records
        if r["status"] == "ok" and r["k"] == 0
    }
    for r in records:
        base = off.get((r["engine"], r["workload"]))
        if r["status"] == "ok" and base:
            r["vs_off"] = r["decode_tok_s"]["median"] / base


def measure_workload(
    backend: SpecBackend,
    engine: str,
    workload: SpecWorkload,
    prompts: Sequence[Sequence[int]],
    config: SpecBenchConfig,
    codec: TextCodec,
    log: Log = _stderr,
) -> list[dict[str, Any]]:
    """The records of one workload on an open backend: without drafts, then each K."""
    cap = config.gen_cap(workload)
    modes = (0, *config.ks)
    runs: dict[int, list[list[RequestRun]]] = {k: [] for k in modes}
    for _ in range(config.repeats):
        # Modes interleaved, so a slow spell of a shared machine hits them all alike.
        for k in modes:
            runs[k].append(
                [
                    run_request(backend, p, cap, config.stop_token_ids, config.speculative(k))
                    for p in prompts
                ]
            )
    expected = [r.ids for r in runs[0][0]]
    records = []
    for k in modes:
        rec = make_record(engine, workload, k, config, prompts, runs[k], expected, codec)
        records.append(rec)
        log(f"  {engine} {workload.name} {'K=' + str(k) if k else 'no drafts'}: {_summary(rec)}")
    return records


def _summary(rec: dict[str, Any]) -> str:
    line = f"{rec['generated_tokens']} tokens, {rec['decode_tok_s']['median']:.1f} tok/s"
    if rec["k"]:
        line += f", {rec['accepted']} of {rec['drafted']} drafted accepted"
    return line + ("" if rec["identical"] else ", OUTPUT DIFFERS")


def warm_up(
    backend: SpecBackend,
    engine: str,
    prompt: Sequence[int],
    tokens: int,
    config: SpecBenchConfig,
) -> None:
    """Untimed requests in every mode: compilation, graph capture and first-use costs of
    the verification pass land here. ``tokens``: at most the workload's cap, which the
    cache was sized for."""
    for k in (0, max(config.ks)):
        run_request(backend, prompt, tokens, frozenset(), config.speculative(k))


def error_record(engine: str, workload: str, exc: BaseException) -> dict[str, Any]:
    return {
        "engine": engine,
        "workload": workload,
        "k": 0,
        "status": "error",
        "error": f"{type(exc).__name__}: {exc}"[:2000],
    }


OpenBackend = Callable[[str, int], SpecBackend]  # (engine, cache positions) -> backend


def run_spec_bench(
    open_backend: OpenBackend,
    codec: TextCodec,
    config: SpecBenchConfig,
    doc: dict[str, Any],
    json_path: str | None = None,
    log: Log = _stderr,
) -> dict[str, Any]:
    """Every engine over every workload into ``doc["records"]`` (written to ``json_path``
    after each workload); returns ``doc``."""
    prompts = {w.name: [codec.encode_prompt(list(r)) for r in w.requests] for w in config.workloads}
    need = max(len(p) + config.gen_cap(w) + 1 for w in config.workloads for p in prompts[w.name])
    max_len = max(need, config.context)
    start = time.perf_counter()
    records: list[dict[str, Any]] = doc["records"]
    for engine in config.engines:
        if _over_budget(config, start):
            doc["skipped"].append({"engine": engine, "reason": "--time-budget reached"})
            continue
        log(f"{engine}: opening with {max_len} cache positions")
        backend: SpecBackend | None = None
        try:
            backend = open_backend(engine, max_len)
            first = config.workloads[0]
            tokens = min(config.warmup_tokens, config.gen_cap(first))
            warm_up(backend, engine, prompts[first.name][0], tokens, config)
            for w in config.workloads:
                if _over_budget(config, start):
                    doc["skipped"].append(
                        {"engine": engine, "workload": w.name, "reason": "--time-budget reached"}
                    )
                    continue
                try:
                    records += measure_workload(
                        backend, engine, w, prompts[w.name], config, codec, log
                    )
                except Exception as e:  # one workload's failure is a record, not the end
                    log(f"  {engine} {w.name}: {type(e).__name__}: {e}")
                    records.append(error_record(engine, w.name, e))
                add_ratios(records)
                _write(doc, json_path)
        except Exception as e:  # the engine would not open or warm up
            log(f"{engine}: {type(e).__name__}: {e}")
            records.append(error_record(engine, "-", e))
        finally:
            if backend is not None:
                backend.close()
            backend = None
            _free_memory()
    add_ratios(records)
    _write(doc, json_path)
    return doc


def _free_memory() -> None:
    """Hand a closed engine's memory back before the next one allocates its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _over_budget(config: SpecBenchConfig, start: float) -> bool:
    return config.time_budget_s is not None and time.perf_counter() - start > config.time_budget_s


def _write(doc: dict[str, Any], path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def new_document(
    environment: dict[str, Any], model: dict[str, Any], args: dict[str, Any]
) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": KIND,
        "environment": environment,
        "model": model,
        "args": args,
        "records": [],
        "skipped": [],
    }


# -- the table ----------------------------------------------------------------------------


def _fmt(value: float | None, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _row(r: dict[str, Any]) -> str:
    head = f"{r['engine']:<9} {r['workload']:<9}"
    if r["status"] != "ok":
        return f"{head}  error: {r['error']}"
    k = str(r["k"]) if r["k"] else "off"
    copied = "-" if r["copied_lines"] is None else "{}/{}".format(*r["copied_lines"])
    repeats = _fmt(r.get("self_repeat"), ".0%")
    same = "yes" if r["identical"] else "NO"
    ratio = _fmt(r["vs_off"], ".2f") + "x" if r["k"] and r["vs_off"] else "-"
    return (
        f"{head} {k:>3} {r['generated_tokens']:>7} {r['decode_tok_s']['median']:>8.1f} "
        f"{ratio:>7} {r['drafted'] if r['k'] else '-':>8} {r['accepted'] if r['k'] else '-':>8} "
        f"{_fmt(r['accepted_per_pass'], '.2f'):>8} {_fmt(r['tokens_per_pass'], '.2f'):>8} "
        f"{copied:>8} {repeats:>8} {same:>9}"
    )


def mismatch_lines(doc: dict[str, Any]) -> list[str]:
    """One ``MISMATCH`` line per record whose output was not the one without drafts."""
    lines = []
    for r in doc["records"]:
        if r["status"] != "ok" or r["identical"]:
            continue
        m = r["mismatch"]
        mode = f"K={r['k']}" if r["k"] else "without drafts (repeat)"
        lines.append(
            f"MISMATCH: {r['engine']} {r['workload']} {mode}: request {m['request'] + 1} "
            f"(repeat {m['repeat'] + 1}) differs from the first run without drafts at token "
            f"{m['index']} (expected {m['expected']}, got {m['got']}; "
            f"{m['expected_tokens']} vs {m['got_tokens']} tokens)"
        )
    return lines


def format_table(doc: dict[str, Any]) -> str:
    env, model = doc["environment"], doc["model"]
    lines = [
        f"device: {env['device']} | model: {model['label']} ({model['weights']} weights, "
        f"{model.get('dtype', '?')}) | "
        "greedy, to EOS or the cap | tok/s: decode, median of repeats",
        f"{'engine':<9} {'workload':<9} {'K':>3} {'tokens':>7} {'tok/s':>8} {'vs off':>7} "
        f"{'drafted':>8} {'accepted':>8} {'acc/pass':>8} {'tok/pass':>8} {'copied':>8} "
        f"{'self-rep':>8} {'identical':>9}",
        *(_row(r) for r in doc["records"]),
    ]
    for s in doc["skipped"]:
        lines.append(f"note: skipped {s['engine']} {s.get('workload', '')}: {s['reason']}".strip())
    lines += mismatch_lines(doc)
    return "\n".join(lines)


# -- from monokernel bench's flags -----------------------------------------------------------


def engine_error(
    labels: Sequence[str],
    ks: Sequence[int],
    ngram_max: int | None = None,
    ngram_min: int | None = None,
) -> str | None:
    """Why these engines, Ks and n-gram bounds (None: each engine's) cannot run the
    workloads (None when they can), with ``run --speculative``'s own messages."""
    from monokernel.cli.validate import speculative_config

    for label in labels:
        for k in ks:
            flags = argparse.Namespace(
                speculative="ngram",
                num_speculative_tokens=k,
                ngram_max=ngram_max,
                ngram_min=ngram_min,
                engine=split_engine(label)[0],
                tp=1,
            )
            error = speculative_config(flags)[1]
            if error is not None:
                return error
        if label not in ENGINES:
            return (
                f"--workload runs the engines that verify drafts ({', '.join(ENGINES)}); "
                f"not {label!r}"
            )
    return None


def checkpoint_backends(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> OpenBackend:
    """Opens an engine's backend on ``ckpt`` as ``monokernel run`` would (runtime/engine.py):
    a 4- or 8-bit checkpoint's own groups (the torch engine on the CPU decodes from them),
    an FP8 one's block scales."""
    from monokernel.bench.engines import fresh_compile_state
    from monokernel.runtime.backends import construct_backend
    from monokernel.weights.lazy_weights import cast_mapping

    def open_backend(engine: str, max_len: int) -> SpecBackend:
        if engine == "torch" and device.type == "cuda":
            fresh_compile_state()
        # The engines that verify drafts compute with the dense matrices, so each backend
        # gets them; made from a GGUF's groups straight into ``dtype`` on ``device``, and
        # ``ckpt.weights`` left unread, so no float32 copy of the model outlives a backend.
        weights = dict(cast_mapping(ckpt.weights, dtype, device))
        fp8 = ckpt.fp8_blocks if ckpt.quantization == "fp8" else None
        backend: Any = construct_backend(
            engine,
            ckpt.config,
            weights,
            max_len,
            device,
            False,
            ckpt.quantization,
            ckpt.groups,
            fp8,
        )
        return backend  # type: ignore[no-any-return]

    return open_backend


def run_workloads(
    args: argparse.Namespace, engines: Sequence[str], device: torch.device, dtype: torch.dtype
) -> int:
    """``monokernel bench --workload ...`` after its flags were checked: 0, or 1 when a
    record failed or an output differed from the one without drafts."""
    from monokernel.bench.environment import environment
    from monokernel.tokenizer.tokenizer import Tokenizer
    from monokernel.weights.loader import load_checkpoint
    from monokernel.workloads.spec_workloads import build

    workloads = tuple(build(n) for n in args.workload)
    ckpt = load_checkpoint(args.model)
    codec = Tokenizer.load(ckpt.tokenizer_dir, ckpt.gguf_file)
    config = SpecBenchConfig(
        engines=tuple(engines),
        workloads=workloads,
        ks=tuple(dict.fromkeys(args.num_speculative_tokens)),
        repeats=args.repeats or 1,
        max_tokens=args.gen_tokens[0] if args.gen_tokens else None,
        context=args.context,
        time_budget_s=args.time_budget,
        stop_token_ids=frozenset(ckpt.eos_token_ids),
        ngram_max=args.ngram_max,
        ngram_min=args.ngram_min,
    )
    limit = ckpt.config.max_position_embeddings
    for w in workloads:
        longest = max(len(codec.encode_prompt(list(r))) for r in w.requests)
        if longest + config.gen_cap(w) + 1 > limit:
            print(
                f"monokernel bench: {w.name}: a {longest}-token prompt and {config.gen_cap(w)} "
                f"generated tokens exceed the model's context ({limit}); lower --gen-tokens",
                file=sys.stderr,
            )
            return 2
    model = {
        "label": args.model or "SmolLM2-135M-Instruct, the default model",
        "source": str(ckpt.source),
        "weights": ckpt.quantization or str(dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),
        "max_context": limit,
    }
    recorded = {k: v for k, v in vars(args).items() if k != "endpoint_api_key"}
    doc = new_document(environment(device), model, recorded)
    run_spec_bench(checkpoint_backends(ckpt, device, dtype), codec, config, doc, args.json_file)
    print(format_table(doc))
    lines = mismatch_lines(doc)
    for line in lines:
        print(line, file=sys.stderr)
    failed = any(r["status"] != "ok" for r in doc["records"])
    return 1 if lines or failed else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m monokernel.bench.spec RESULTS.json``: the table again."""
    ap = argparse.ArgumentParser(prog="python -m monokernel.bench.spec")
    ap.add_argument("results", help="a --workload JSON of monokernel bench")
    args = ap.parse_args(argv)
    doc = json.loads(Path(args.results).read_text())
    if doc.get("kind") != KIND:
        print(f"{args.results}: not a monokernel bench --workload result", file=sys.stderr)
        return 2
    print(format_table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
