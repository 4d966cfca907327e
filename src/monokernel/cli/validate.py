"""Checks on `monokernel run` and `monokernel serve` flags, made before the model loads.

The ``type=`` functions below reject a malformed value as argparse parses it, so the error
names the flag as typed (``argument --top-p: ...``) and exits 2 with no traceback. The
ranges match :class:`monokernel.runtime.sampling.SamplingParams`, which would otherwise
refuse the same values later under their API names (``top_p``). ``machine_error`` checks
what depends on this machine (GPUs, engines); it reuses the engine's own rules so the CLI
cannot drift from what the engine accepts.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import TYPE_CHECKING

from monokernel.runtime.speculative import DEFAULT_DRAFT, MAX_DRAFT

if TYPE_CHECKING:
    from monokernel.runtime.speculative import SpeculativeConfig

_DEVICE = re.compile(r"(auto|cpu|cuda)(?::(\d+))?")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer; got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number; got {text!r}") from None
    # NaN passes every comparison test as false and inf is never a meaningful setting.
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number; got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (``--max-tokens``, ``--max-model-len``, ``--tp``)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (``--seed``)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0; got {text}")
    return value


def port(text: str) -> int:
    """A TCP port, 0-65535 (``serve --port``; 0 lets the system pick one)."""
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 0-65535; got {text}")
    return value


def top_k(text: str) -> int:
    """An integer >= -1; 0 and -1 both turn top-k off, as SamplingParams takes it."""
    value = _int(text)
    if value < -1:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= 0 (0 or -1 turn it off); got {text}"
        )
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (``--temperature``)."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = greedy); got {text}")
    return value


def probability(text: str) -> float:
    """A number in (0, 1] (``--top-p``); 0 would keep no token at all."""
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1]; got {text}")
    return value


def non_empty(text: str) -> str:
    """Any text but the empty string (``--stop``: an empty stop string would match at once)."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def device_spec(text: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``, by syntax only; ``machine_error`` checks
    that the GPU exists, because that needs torch and this runs for every parse."""
    match = _DEVICE.fullmatch(text)
    if match is None or (match.group(2) is not None and match.group(1) != "cuda"):
        raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N; got {text!r}")
    return text


def _gpus(count: int) -> str:
    return f"{count} CUDA GPU" + ("" if count == 1 else "s")


def machine_error(device: str, engine: str, tp: int) -> str | None:
    """Why ``--device``/``--engine``/``--tp`` cannot run on this machine, in argparse's
    ``argument FLAG: ...`` form; None when they can. Cheap: no model, no kernel build."""
    # Imported here so the type= checks above need no torch (monokernel/__init__.py
    # imports the engine, so the CLI has torch loaded by now anyway).
    import torch

    from monokernel.errors import BackendUnavailableError
    from monokernel.runtime.backends import resolve_engine

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        resolved = torch.device("cuda" if count else "cpu")
    else:
        resolved = torch.device(device)
        if resolved.type == "cuda" and count == 0:
            return (
                f"argument --device: {device!r} needs a CUDA GPU, and none is visible on "
                "this machine; use auto or cpu"
            )
        if resolved.index is not None and resolved.index >= count:
            return (
                f"argument --device: {device!r} is out of range; this machine has "
                f"{_gpus(count)} (cuda:0..cuda:{count - 1})"
            )
    if tp > 1:
        if device == "cpu":
            return f"argument --tp: --tp {tp} needs {tp} CUDA GPUs, not --device cpu"
        first = resolved.index or 0
        if first + tp > count:
            where = "" if first == 0 else f" from cuda:{first} on"
            return (
                f"argument --tp: --tp {tp} needs {tp} CUDA GPUs{where}; this machine has "
                f"{_gpus(count)}"
            )
    try:
        name = resolve_engine(engine, resolved)
    except BackendUnavailableError as e:
        return f"argument --engine: {e}"
    if tp > 1 and name != "monokernel":
        # create_backend's rule, checked here so it fails before the load, not after it.
        return (
            f"argument --tp: --tp {tp} needs engine 'monokernel' (Hopper GPUs with nvcc); "
            f"--engine {engine} runs {name!r} here"
        )
    return None


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The flags `run` and `serve` share: which engine, on which device, in which dtype, over
    how many GPUs, with how much context. ``machine_error`` checks them against the machine."""
    p.add_argument("--engine", default="auto", choices=["auto", "reference", "torch", "monokernel"])
    p.add_argument("--device", type=device_spec, default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        help="tensor-parallel GPUs for one request (monokernel engine, N Hopper GPUs)",
    )
    p.add_argument(
        "--max-model-len", type=positive_int, default=None, help="context size to allocate"
    )
    p.add_argument(
        "--quantize",
        choices=["fp8", "int8", "int4"],
        default=None,
        help="quantise the layers' weights at load: fp8 (E4M3) and int8 (symmetric) with one "
        "scale per output channel, int4 with a scale and offset per 128 input columns; the "
        "LM head and the embedding keep the checkpoint's format",
    )
    add_speculative_flags(p)


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    """`--speculative` and its bounds (run, serve, agent-bench); ``speculative_config``
    turns them into the engine's config."""
    spec = p.add_argument_group("speculative decoding (docs/speculative.md)")
    spec.add_argument(
        "--speculative",
        choices=["ngram", "off"],
        default=None,
        help="ngram: draft from the request's own tokens (n-gram lookup) and verify several a "
        "pass; the same tokens, fewer passes where the output repeats its context. Default: "
        "ngram where it measured no loss on chat (the monokernel where the model's passes "
        "fit, on one GPU; the torch engine's packed CPU step), off elsewhere; off: never",
    )
    spec.add_argument(
        "--num-speculative-tokens",
        type=positive_int,
        default=DEFAULT_DRAFT,
        help=f"tokens drafted a pass at most (1-{MAX_DRAFT}, default {DEFAULT_DRAFT})",
    )
    spec.add_argument(
        "--ngram-max",
        type=positive_int,
        default=None,
        help="longest suffix matched (default 4; 6 on the monokernel, whose requests move "
        "from steps to passes where this many tokens repeat)",
    )
    spec.add_argument(
        "--ngram-min",
        type=positive_int,
        default=None,
        help="shortest suffix matched (default 2; 3 on the monokernel)",
    )


def speculative_config(
    args: argparse.Namespace,
) -> tuple[SpeculativeConfig | None, str | None]:
    """(the SpeculativeConfig the flags ask for or None, argparse's error line or None).
    Without --speculative: the engine's default (a config marked ``by_default``, which the
    engine drops where it does not draft by default), none under --tp > 1."""
    by_default = args.speculative is None
    if args.speculative == "off" or (by_default and args.tp > 1):
        return None, None
    from monokernel.errors import InvalidRequestError
    from monokernel.kernels.build import MAX_PASS_POSITIONS
    from monokernel.runtime.speculative import SpeculativeConfig

    try:
        config = SpeculativeConfig(
            "ngram", args.num_speculative_tokens, args.ngram_max, args.ngram_min, by_default
        )
        config.bounds("monokernel" if args.engine == "monokernel" else "")
    except InvalidRequestError as e:
        return None, f"argument --speculative: {e}"
    if args.engine == "monokernel" and config.num_tokens >= MAX_PASS_POSITIONS:
        return None, (
            f"argument --speculative: the monokernel verifies at most "
            f"{MAX_PASS_POSITIONS - 1} drafted tokens a pass; got {config.num_tokens} "
            "(--num-speculative-tokens)"
        )
    if args.tp > 1:
        return None, "argument --speculative: not with --tp > 1 (the monokernel's TP build)"
    return config, None
