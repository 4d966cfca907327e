"""`monokernel perplexity`: a model's perplexity on the packaged text, to compare
``--quantize fp8|int8|int4`` with the checkpoint as loaded (runtime/perplexity.py)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from monokernel.runtime.perplexity import DEFAULT_WINDOW

# weights.quantize.QUANTIZE_METHODS, spelled out so that `-h` and a bad flag need no import
# of the weight formats; test_perplexity checks that the two agree.
QUANTIZE_CHOICES: tuple[str, ...] = ("fp8", "int8", "int4")
DEVICES: tuple[str, ...] = ("cpu", "cuda")


def _at_least_two(text: str) -> int:
    """A token count that leaves one token to score after the first (``--window``,
    ``--max-tokens``). Parsed here, not with cli/validate's helpers: the runtime layer may
    not import the CLI's (tests/test_repo.py)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer; got {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (one token of context); got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="monokernel perplexity",
        description=(
            "Perplexity of a model on a fixed text shipped with monokernel (~10k tokens of "
            "design prose, code, README, changelog and narrative), computed with the float32 "
            "reference forward; with --quantize, of its fp8, int8 or int4 weights, to compare "
            "(int4 searched with input statistics from a separate calibration text)."
        ),
    )
    p.add_argument(
        "--model",
        default=None,
        help="HF directory, .gguf file or hub id (default: SmolLM2-135M-Instruct, downloaded once)",
    )
    p.add_argument(
        "--quantize",
        choices=QUANTIZE_CHOICES,
        default=None,
        help="quantise each layer's matrices as --quantize does for the engines (default: none)",
    )
    p.add_argument(
        "--max-tokens",
        type=_at_least_two,
        metavar="N",
        default=None,
        help="score only the text's first N tokens (default: the whole text)",
    )
    p.add_argument(
        "--window",
        type=_at_least_two,
        metavar="N",
        default=DEFAULT_WINDOW,
        help=f"tokens a window, each scored from an empty cache (default {DEFAULT_WINDOW})",
    )
    p.add_argument("--device", choices=DEVICES, default="cpu", help="default cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: cuda was asked for but no CUDA GPU is visible")

    from monokernel.errors import InvalidRequestError
    from monokernel.models.config import ModelConfig
    from monokernel.runtime.perplexity import perplexity, text_ids
    from monokernel.tokenizer.tokenizer import Tokenizer
    from monokernel.weights.loader import Announced, load_checkpoint
    from monokernel.weights.safetensors_loader import cast_weights

    def check_window(cfg: ModelConfig, _announced: Announced) -> None:
        # Positions past the model's context score a model that was never trained there;
        # refused before the weights are read.
        if args.window > cfg.max_position_embeddings:
            raise InvalidRequestError(
                f"--window {args.window} exceeds the model's {cfg.max_position_embeddings} "
                "positions; pass a smaller --window"
            )

    progress = not args.json
    device = torch.device(args.device)
    ckpt = load_checkpoint(
        args.model,
        progress=progress,
        device=device,
        dtype=torch.float32,
        before_weights=check_window,
    )
    # float32: the reference's precision, so the unquantised run is the checkpoint's own
    # values (bf16 and dequantised GGUF weights are exact in float32).
    weights = cast_weights(ckpt.weights, torch.float32, device)
    tokenizer = Tokenizer.load(ckpt.tokenizer_dir, ckpt.gguf_file, progress=progress)
    if args.quantize is not None:
        from monokernel.weights.quantize import fake_quantize

        stats = None
        if args.quantize == "int4":  # weighted by the inputs, as the engines' int4 is
            from monokernel.runtime.calibration import calibration_stats

            stats = calibration_stats(ckpt.config, weights, tokenizer, device, progress)
        weights = fake_quantize(weights, args.quantize, stats=stats)
    ids = text_ids(tokenizer, args.max_tokens)
    if progress:
        print(
            f"scoring {len(ids)} tokens in windows of {args.window} on {device}",
            file=sys.stderr,
        )
    result = perplexity(ckpt.config, weights, ids, window=args.window)
    quantize = args.quantize or "none"
    if args.json:
        print(
            json.dumps(
                {
                    "model": ckpt.source,
                    "quantize": args.quantize,
                    "tokens": result.tokens,
                    "nll": result.nll,
                    "ppl": result.ppl,
                    "window": args.window,
                    "device": str(device),
                }
            )
        )
    else:
        print(
            f"model {ckpt.source} | quantize {quantize} | tokens {result.tokens} | "
            f"nll {result.nll:.6f} | ppl {result.ppl:.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
