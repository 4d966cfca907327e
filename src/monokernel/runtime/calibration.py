"""Input statistics of each layer matrix over a calibration text, for ``--quantize int4``.

The int4 search (weights/group_quant.py quantize_rtn) weighs each weight's squared error by
the mean square of the input it multiplies, so the groups' grids spend their 16 steps where
the layer's output is sensitive (AWQ's observation: a few input channels carry most of the
activation). Those means come from here: the reference forward (models/transformer.py) in
float32 over the packaged calibration text (``workloads/texts/calibration.txt``, a coding
agent's session of code, logs and prose written for this repository), in windows of
``CALIBRATION_WINDOW`` tokens from an empty cache, recording the input of every F.linear
whose weight is a layer matrix. That text is not the perplexity text
(runtime/perplexity.py), so `monokernel perplexity --quantize int4` does not score the
model on what it was calibrated with.

Statistics are computed once per checkpoint, where its weights become int4 for every engine
(runtime/engine.py, runtime/perplexity_cli.py), and handed to each packer: the same
statistics give every engine, and every tensor-parallel rank's block (``shard_stats``), the
same int4 weights. They are deterministic on one device, not across devices (float32 sums
in another order).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from monokernel.models.config import ModelConfig
from monokernel.models.transformer import Transformer
from monokernel.runtime.perplexity import TextEncoder, read_text
from monokernel.weights.progress import slow_step
from monokernel.weights.quantize import LINEAR_NAMES
from monokernel.weights.shard import shard_config

CALIBRATION_PARTS: tuple[str, ...] = ("texts", "calibration.txt")
# Tokens of the text used (all of it: ~5,300 for a SmolLM2-style BPE), a window each this
# many, as the perplexity windows are.
CALIBRATION_TOKENS = 8192
CALIBRATION_WINDOW = 1024
# The matrices whose input is recorded; the others share it (fused matrices share their
# input's statistics): Q, K and V read the attention norm's output, up the MLP norm's.
SHARED_INPUT: dict[str, str] = {"wk": "wq", "wv": "wq", "w_up": "w_gate"}
RECORDED: tuple[str, ...] = tuple(m for m in LINEAR_NAMES if m not in SHARED_INPUT)


def calibration_ids(tokenizer: TextEncoder, max_tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """The calibration text's token ids (special tokens as the tokenizer adds them by
    default), the first ``max_tokens`` of them."""
    return list(tokenizer.encode(read_text(CALIBRATION_PARTS)))[:max_tokens]


class _Tracked(Mapping[str, torch.Tensor]):
    """``weights`` as float32 on ``device``, one tensor at a time (a bf16 model is never
    copied whole), remembering which tensor object is which recorded matrix."""

    def __init__(self, weights: Mapping[str, torch.Tensor], device: torch.device) -> None:
        self._w, self._device = weights, device
        self.names: dict[int, str] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._w[name].to(device=self._device, dtype=torch.float32)
        # Keyed by id: a tensor alive at F.linear was made by the last access that returned
        # it; any other access drops the key, as a freed matrix's id may come back.
        parts = name.split(".")
        if len(parts) == 3 and parts[0] == "layers" and parts[2] in RECORDED:
            self.names[id(t)] = name
        else:
            self.names.pop(id(t), None)
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._w)

    def __len__(self) -> int:
        return len(self._w)


class _InputSquares(TorchFunctionMode):
    """Sums, per input column, the squares of the inputs of F.linear calls whose weight is
    one of ``names``' tensors, in float64."""

    def __init__(self, names: Mapping[int, str]) -> None:
        super().__init__()
        self.names = names
        self.sums: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}

    def __torch_function__(
        self,
        func: object,
        types: object,
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and isinstance(args[0], torch.Tensor):
            name = self.names.get(id(args[1]))
            if name is not None:
                x = args[0].reshape(-1, args[0].shape[-1])
                sq = (x * x).sum(dim=0, dtype=torch.float64)
                self.sums[name] = self.sums[name] + sq if name in self.sums else sq
                self.rows[name] = self.rows.get(name, 0) + x.shape[0]
        return func(*args, **kwargs)  # type: ignore[operator]


def activation_stats(
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    ids: Sequence[int],
    window: int = CALIBRATION_WINDOW,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Mean x^2 of each input column of each layer matrix over ``ids``, scored as windows of
    ``window`` tokens from an empty cache: by weight name ("layers.{n}.wq", ...), float32
    [cols] on the CPU. Q, K and V share one vector (the attention norm's output), gate and
    up another (the MLP norm's); O's is the attention's output, down's silu(gate) * up.
    The reference forward in float32 on ``device`` (default: where ``weights`` lie), each
    weight converted as it is read."""
    if not ids:
        raise ValueError("activation statistics need at least one token")
    window = min(window, cfg.max_position_embeddings)
    dev = torch.device(device) if device is not None else weights["embed"].device
    tracked = _Tracked(weights, dev)
    model = Transformer(cfg, tracked, min(window, len(ids)))  # type: ignore[arg-type]
    tokens = torch.tensor(list(ids), dtype=torch.long, device=dev)
    recorder = _InputSquares(tracked.names)
    with torch.inference_mode(), recorder:
        for start in range(0, len(ids), window):
            part = tokens[start : start + window]
            # last_only: the LM head (a fifth of the default model's work) is not wanted.
            model.forward(part, 0, model.new_cache(part.shape[0]), last_only=True)
    stats: dict[str, torch.Tensor] = {}
    for n in range(cfg.num_layers):
        for m in LINEAR_NAMES:
            name = f"layers.{n}.{SHARED_INPUT.get(m, m)}"
            total = recorder.sums[name] / recorder.rows[name]
            stats[f"layers.{n}.{m}"] = total.float().cpu()
    return stats


def calibration_stats(
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    tokenizer: TextEncoder,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> dict[str, torch.Tensor]:
    """``activation_stats`` over the packaged calibration text; ``progress``: a note on
    stderr if it takes over a second (~15 s for the default model on 2 CPU cores)."""
    ids = calibration_ids(tokenizer)
    with slow_step(
        f"--quantize int4: input statistics over {len(ids)} calibration tokens", progress
    ):
        return activation_stats(cfg, weights, ids, device=device)


def shard_stats(
    cfg: ModelConfig, stats: Mapping[str, torch.Tensor], rank: int, tp: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s statistics for its blocks of the layer matrices (weights/shard.py):
    the matrices split by row keep their whole inputs', O and down (split by input column)
    take their columns' slice."""
    sc = shard_config(cfg, rank, tp)
    cols = {
        "wo": (rank * sc.q_size, sc.q_size),
        "w_down": (rank * sc.intermediate, sc.intermediate),
    }
    out: dict[str, torch.Tensor] = {}
    for name, s in stats.items():
        m = name.rsplit(".", 1)[-1]
        if m in cols:
            start, size = cols[m]
            s = s[start : start + size]
        out[name] = s
    return out
