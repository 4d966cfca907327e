"""Load an HF checkpoint directory (one or sharded ``*.safetensors``) into our names.

Without a target device or dtype the tensors are views of each file's memory map, as they
always were. With one (the engine's GPU and bfloat16), each tensor is read straight into
its place on that device, on a GPU through two small pinned staging buffers (the next
chunk is read from disk while the last one is copied), and cast there: the host never
holds more than those buffers, where reading everything to the CPU first would hold a
full copy of an 8B or 32B model (16-65 GB) and copy it twice.

An FP8 checkpoint (weights/checkpoint_quant.py) also holds a scale tensor a quantised
weight: each float8 weight is read as it is, then replaced, once its scale has been read,
by ``q * scale`` in the asked-for dtype (bfloat16 for the memory-mapped path) on the same
device, one matrix at a time; the scales are not part of the result.

A 4-bit checkpoint (AWQ, GPTQ) holds packed tensors a quantised module instead of its
weight (``qweight``, ``qzeros``, ``scales``, GPTQ's ``g_idx``): they are read as they are,
and once a module's are all in, decoded to a GroupQuant (the same bits, unpacked) on the
same device. A layer linear weight stays that GroupQuant: the weights come back as a
LazyWeights (weights/lazy_weights.py) that makes its dense values in the asked-for dtype
(bfloat16 when none) only when it is read, and its GroupQuant comes back too
(``load_safetensors_tensors``). The monokernel streams the groups and never reads those
weights, so the device holds the groups (a byte a weight) and not also a bf16 copy of every
layer (two bytes): a 32B model's 62 GB of bf16 layers beside its 33 GB of groups fit no
80 GB GPU. Any other 4-bit module (a GPTQ LM head) is made dense at once, its GroupQuant
dropped: every engine reads it.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch

from monokernel.errors import (
    MissingTensorError,
    ModelNotFoundError,
    TensorShapeError,
    UnexpectedTensorError,
    WeightLoadError,
)
from monokernel.models.config import ModelConfig
from monokernel.weights.checkpoint_quant import (
    ACTIVATION_TENSORS,
    FLOAT8_DTYPES,
    PACKED_PARTS,
    REQUIRED_PARTS,
    SCALE_SUFFIX,
    CheckpointQuant,
    Fp8Blocks,
    Int4Quant,
    check_scale_shape,
    decode_int4,
    dequantize,
    factor,
    packed_shapes,
    scaled_weight,
)
from monokernel.weights.group_quant import GroupQuant, GroupQuantError, gptq_trivial_g_idx
from monokernel.weights.lazy_weights import DenseSource, LazyWeights, cast_mapping
from monokernel.weights.names import HF_IGNORED, Weights, check_weights, hf_to_ours
from monokernel.weights.progress import ByteProgress, progress_wanted
from monokernel.weights.quantize import UnsupportedQuantizationError, is_quantized

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# The safetensors format's own names; the file is little-endian, as every host we run on.
ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
ST_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in ST_DTYPES.items()}
_MAX_HEADER = 100_000_000  # the safetensors library's own limit
# Large enough that a read is one cheap syscall and a copy saturates PCIe, small enough
# that the two pinned buffers cost nothing next to the model.
STAGE_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a safetensors file, as its header describes it."""

    name: str  # the HF name
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


def safetensors_files(model_dir: Path) -> list[Path]:
    """The shard files of a checkpoint, from its index when sharded."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelNotFoundError(f"{index} names shard(s) that are missing: {absent}")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return found
    raise ModelNotFoundError(
        f"{model_dir} holds no {SINGLE_FILE}, {INDEX_FILE} or other *.safetensors file"
    )


def read_header(path: Path) -> list[TensorEntry]:
    """The tensors of one safetensors file, in file order; refuses a corrupt or truncated
    file before anything is read from it."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise WeightLoadError(f"{path}: too short to be a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise WeightLoadError(f"{path}: header length {n} does not fit the file ({size})")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightLoadError(f"{path}: the header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise WeightLoadError(f"{path}: the header is not a JSON object")
    data_start, data_len = 8 + n, size - 8 - n
    entries: list[TensorEntry] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise WeightLoadError(f"{path}: malformed header entry for {name}: {info}") from e
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise WeightLoadError(f"{path}: tensor {name} has a malformed shape {shape}")
        if dtype_name not in ST_DTYPES:
            raise WeightLoadError(f"{path}: tensor {name} has unsupported dtype {dtype_name}")
        dtype = ST_DTYPES[dtype_name]
        nbytes = math.prod(shape) * dtype.itemsize
        if not 0 <= begin <= end <= data_len or end - begin != nbytes:
            raise WeightLoadError(
                f"{path}: tensor {name} ({dtype_name} {shape}) has data offsets "
                f"[{begin}, {end}] in a data section of {data_len} bytes"
            )
        entries.append(TensorEntry(name, dtype, tuple(shape), data_start + begin, nbytes))
    return sorted(entries, key=lambda e: e.offset)


class _StagedReader:
    """Reads a tensor's bytes from a file into a new tensor on ``device``, in chunks.

    To a GPU through two pinned staging buffers that alternate: a chunk's copy runs
    asynchronously while the next chunk is read from the file, and an event per buffer
    says when it may be refilled. To the CPU straight into the tensor; ``staged`` forces
    the staging path there, synchronous, so the CPU tests can check its chunking.
    """

    def __init__(self, device: torch.device, chunk: int, staged: bool | None = None) -> None:
        self.device = device
        self.chunk = chunk
        self.staged = device.type != "cpu" if staged is None else staged
        self.pinned = device.type == "cuda"
        n = 2 if self.staged else 0
        self.buffers = [
            torch.empty(chunk, dtype=torch.uint8, pin_memory=self.pinned) for _ in range(n)
        ]
        self.views = [memoryview(b.numpy()) for b in self.buffers]
        self.events = [torch.cuda.Event() for _ in self.buffers] if self.pinned else []
        # copy_ to a CUDA tensor runs on the current stream of its device: record there.
        self.stream = torch.cuda.current_stream(device) if self.pinned else None
        self.turn = 0

    def read(
        self, fh: io.FileIO, path: Path, entry: TensorEntry, on_bytes: Callable[[int], None]
    ) -> torch.Tensor:
        raw = torch.empty(entry.nbytes, dtype=torch.uint8, device=self.device)
        direct = None if self.staged else memoryview(raw.numpy())
        if fh.tell() != entry.offset:
            fh.seek(entry.offset)
        done = 0
        while done < entry.nbytes:
            k = min(self.chunk, entry.nbytes - done)
            if direct is not None:
                _read_exactly(fh, direct[done : done + k], path)
            else:
                self._stage(fh, path, raw[done : done + k])
            done += k
            on_bytes(k)
        return raw.view(entry.dtype).view(entry.shape)

    def _stage(self, fh: io.FileIO, path: Path, dest: torch.Tensor) -> None:
        i = self.turn
        self.turn = (i + 1) % len(self.buffers)
        k = dest.numel()
        if self.pinned:
            self.events[i].synchronize()  # the copy out of this buffer has finished
        _read_exactly(fh, self.views[i][:k], path)
        dest.copy_(self.buffers[i][:k], non_blocking=self.pinned)
        if self.pinned:
            self.events[i].record(self.stream)


def _read_exactly(fh: io.FileIO, view: memoryview, path: Path) -> None:
    got = 0
    while got < len(view):
        n = fh.readinto(view[got:])
        if not n:
            raise WeightLoadError(f"{path}: file ended while reading tensor data (truncated?)")
        got += n


Quant = CheckpointQuant | Int4Quant | None


def _side_tensor(hf_name: str, quant: Quant) -> tuple[str, str] | None:
    """(our weight, our name for this tensor) when ``hf_name`` is an FP8 weight's scale
    ("layers.0.wq", "layers.0.wq.scale") or a 4-bit module's packed tensor ("layers.0.wq",
    "layers.0.wq.qweight"); None for any other tensor."""
    if isinstance(quant, CheckpointQuant):
        weight = scaled_weight(hf_name, quant)
        of = hf_to_ours(weight) if weight is not None else None
        return (of, of + SCALE_SUFFIX) if of is not None else None
    if isinstance(quant, Int4Quant):
        module, _, part = hf_name.rpartition(".")
        of = hf_to_ours(module + ".weight") if part in PACKED_PARTS else None
        return (of, f"{of}.{part}") if of is not None else None
    return None


def _weight_of(ours: str) -> str | None:
    """The weight a scale or packed tensor (as _side_tensor names it) belongs to; None
    for a weight (no name of ours ends as those do)."""
    head, _, tail = ours.rpartition(".")
    return head if "." + tail == SCALE_SUFFIX or tail in PACKED_PARTS else None


def _plan(
    files: list[Path], cfg: ModelConfig, source: str, quant: Quant = None
) -> list[tuple[Path, list[tuple[TensorEntry, str | None]]]]:
    """Each file's tensors with our name (None: ignored), and the names and shapes checked
    from the headers alone, so a broken 16 GB checkpoint fails before a byte is read.

    With an FP8 ``quant``, a weight's scale is ours too: the weight's name plus
    SCALE_SUFFIX ("layers.0.wq.scale"); activation tensors of the scheme are ignored; every
    float8 weight must have a scale that fits it, and every scale a float8 weight. With a
    4-bit one, a module's packed tensors are the weight's name plus the part
    ("layers.0.wq.qweight"), and must fit together. The checks against ``cfg`` see the
    weights alone (a 4-bit module's as the [out, in] its tensors decode to)."""
    plan: list[tuple[Path, list[tuple[TensorEntry, str | None]]]] = []
    where: dict[str, Path] = {}
    meta: Weights = {}
    headers: dict[str, TensorEntry] = {}  # our weight name -> its entry
    scales: dict[str, TensorEntry] = {}  # our weight name -> its scale's entry
    packed: dict[str, dict[str, TensorEntry]] = {}  # our weight name -> part -> entry
    fp8 = isinstance(quant, CheckpointQuant)
    for path in files:
        named: list[tuple[TensorEntry, str | None]] = []
        for e in read_header(path):
            if HF_IGNORED.match(e.name) or (fp8 and ACTIVATION_TENSORS.match(e.name)):
                named.append((e, None))
                continue
            ours = hf_to_ours(e.name)
            side = _side_tensor(e.name, quant) if ours is None else None
            ours = side[1] if side is not None else ours
            if ours is None:
                raise UnexpectedTensorError(
                    f"{path.name}: tensor {e.name} is not used by a {cfg.family} model"
                )
            if ours in where:
                raise UnexpectedTensorError(
                    f"{source}: tensor {e.name} is in both {where[ours].name} and {path.name}"
                )
            where[ours] = path
            named.append((e, ours))
            if side is None:
                headers[ours] = e
                meta[ours] = torch.empty(e.shape, dtype=e.dtype, device="meta")
            elif fp8:
                scales[side[0]] = e
            else:
                packed.setdefault(side[0], {})[ours.rpartition(".")[2]] = e
        plan.append((path, named))
    _check_scales(headers, scales, quant, source)
    if isinstance(quant, Int4Quant):
        meta |= _check_packed(packed, headers, quant, source)
    if cfg.tie_word_embeddings:
        # Whether a tied lm_head equals embed needs the values: the full check does it.
        meta.pop("lm_head", None)
    check_weights(meta, cfg, source=source)
    return plan


def _check_scales(
    weights: dict[str, TensorEntry],
    scales: dict[str, TensorEntry],
    quant: Quant,
    source: str,
) -> None:
    """Each float8 weight paired with a scale of the scheme's shape, and each scale with a
    float8 weight; the error names the tensor."""
    for ours, e in weights.items():
        if e.dtype not in FLOAT8_DTYPES or ours in scales:
            continue
        if not isinstance(quant, CheckpointQuant):
            raise WeightLoadError(
                f"{source}: tensor {e.name} is {e.dtype} but config.json has no "
                + ("quantization_config" if quant is None else "FP8 quantization_config")
                + ", so its scales are unknown"
            )
        raise MissingTensorError(
            f"{source}: tensor {e.name} is {e.dtype} but has no scale "
            f"({e.name.removesuffix('.weight')}.{quant.scale_suffix}) in any shard"
        )
    if not scales:
        return
    assert isinstance(quant, CheckpointQuant)  # only an FP8 scheme names scales
    for ours, se in scales.items():
        w = weights.get(ours)
        if w is None:
            raise UnexpectedTensorError(
                f"{source}: tensor {se.name} is a scale but its weight "
                f"{scaled_weight(se.name, quant)} is in no shard"
            )
        if w.dtype not in FLOAT8_DTYPES:
            raise UnexpectedTensorError(
                f"{source}: tensor {se.name} scales {w.name}, which is {w.dtype}, not float8"
            )
        if not se.dtype.is_floating_point or se.dtype in FLOAT8_DTYPES:
            raise WeightLoadError(
                f"{source}: scale {se.name} is {se.dtype}; expected float32, bfloat16 or float16"
            )
        check_scale_shape(se.name, w.shape, se.shape, quant)


def _check_packed(
    packed: dict[str, dict[str, TensorEntry]],
    weights: dict[str, TensorEntry],
    quant: Int4Quant,
    source: str,
) -> Weights:
    """Each 4-bit module's tensors complete, of the packing's dtypes and of shapes that fit
    together; the error names the tensor. Returns each module's weight as a meta tensor of
    the [out, in] shape it decodes to, for the checks against the config."""
    out: Weights = {}
    for ours, parts in packed.items():
        module = next(iter(parts.values())).name.rpartition(".")[0]
        if ours in weights:
            raise UnexpectedTensorError(
                f"{source}: {module} has both a weight and 4-bit tensors ({', '.join(parts)})"
            )
        missing = [f"{module}.{p}" for p in REQUIRED_PARTS if p not in parts]
        if missing:
            raise MissingTensorError(
                f"{source}: 4-bit module {module} has no {', '.join(missing)} in any shard"
            )
        if quant.method == "awq" and "g_idx" in parts:
            raise UnexpectedTensorError(f"{source}: tensor {module}.g_idx in an AWQ checkpoint")
        shapes = packed_shapes(quant, parts["qweight"].shape)
        if not shapes:
            group = "one group a row" if quant.group == -1 else f"groups of {quant.group}"
            raise TensorShapeError(
                f"{source}: tensor {module}.qweight of shape {parts['qweight'].shape} is no "
                f"{quant.method} packing of an [out, in] weight in {group} (in a multiple "
                "of the group, the group of 32)"
            )
        for part, e in parts.items():
            _check_part(e, part, shapes[part], quant.method)
        out[ours] = torch.empty(shapes["weight"], dtype=torch.float32, device="meta")
    return out


def _check_part(e: TensorEntry, part: str, shape: tuple[int, ...], method: str) -> None:
    if part in ("qweight", "qzeros"):
        ok, want = e.dtype == torch.int32, "int32"
    elif part == "scales":
        ok, want = e.dtype.is_floating_point and e.dtype not in FLOAT8_DTYPES, "float16"
    else:
        ok, want = not e.dtype.is_floating_point and e.dtype != torch.bool, "int32"
    if not ok:
        raise WeightLoadError(f"tensor {e.name} is {e.dtype}; a {method} {part} is {want}")
    if e.shape != shape:
        raise TensorShapeError(
            f"tensor {e.name} has shape {e.shape}; its module's qweight makes it {shape}"
        )


def _dequantize_ready(
    pending: Weights,
    quant: CheckpointQuant,
    dtype: torch.dtype | None,
    blocks: dict[str, torch.Tensor],
) -> Weights:
    """The float8 weights of ``pending`` whose scale is there too, each replaced by
    ``q * scale`` in ``dtype`` (bfloat16 when None); both leave ``pending``. One at a time,
    so the extra memory is one matrix's float32 product. With block scales, a layer linear
    weight's (as the float32 factor) also goes to ``blocks``."""
    out: Weights = {}
    for name in [n for n in pending if not n.endswith(SCALE_SUFFIX)]:
        if name + SCALE_SUFFIX in pending:
            q, s = pending.pop(name), pending.pop(name + SCALE_SUFFIX)
            out[name] = dequantize(q, s, quant, name=name).to(dtype or torch.bfloat16)
            if quant.strategy == "block" and is_quantized(name):
                blocks[name] = factor(s, quant, q.device)
            del q, s
    return out


def _decode_ready(
    pending: Weights,
    quant: Int4Quant,
    dtype: torch.dtype | None,
    modules: dict[str, tuple[str, frozenset[str]]],
    groups: dict[str, GroupQuant],
    source: str,
) -> dict[str, torch.Tensor | DenseSource]:
    """The 4-bit modules of ``pending`` whose tensors are all there, each decoded to a
    GroupQuant; the packed tensors leave ``pending``. A layer linear weight's GroupQuant
    goes to ``groups`` and the weight is its DenseSource in ``dtype`` (bfloat16 when None),
    made only if read; any other module's weight is its dense values in that dtype.
    ``modules``: our weight name -> (HF module name, its parts)."""
    out: dict[str, torch.Tensor | DenseSource] = {}
    for name, (module, parts) in modules.items():
        keys = [f"{name}.{p}" for p in parts]
        if not all(k in pending for k in keys):
            continue
        tensors = {p: pending.pop(k) for p, k in zip(parts, keys, strict=True)}
        try:
            gq = decode_int4(tensors, quant)
        except (GroupQuantError, UnsupportedQuantizationError) as e:
            raise type(e)(f"{source}: {quant.method} module {module}: {e}") from e
        del tensors
        if is_quantized(name):
            groups[name] = gq
            # Made only if read (the monokernel never does), with gq.dense(dtype)'s bits.
            out[name] = DenseSource(gq, dtype=dtype or torch.bfloat16)
        else:
            out[name] = gq.dense(dtype or torch.bfloat16)
    return out


def _packed_modules(
    plan: list[tuple[Path, list[tuple[TensorEntry, str | None]]]],
) -> dict[str, tuple[str, frozenset[str]]]:
    """Our weight name -> (HF module name, the parts it has) for every 4-bit module (the
    plan of a 4-bit checkpoint: its only side tensors are packed ones)."""
    parts: dict[str, set[str]] = {}
    hf: dict[str, str] = {}
    for _, named in plan:
        for e, o in named:
            weight = _weight_of(o) if o is not None else None
            if o is not None and weight is not None:
                parts.setdefault(weight, set()).add(o.rpartition(".")[2])
                hf[weight] = e.name.rpartition(".")[0]
    return {w: (hf[w], frozenset(p)) for w, p in parts.items()}


def load_safetensors_weights(
    model_dir: Path,
    cfg: ModelConfig,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    progress: bool = False,
    force_progress: bool = False,
    quant: CheckpointQuant | Int4Quant | None = None,
) -> MutableMapping[str, torch.Tensor]:
    """Every tensor in our names, checked against ``cfg``.

    ``device``/``dtype`` None: memory-mapped CPU views in the checkpoint's dtype. Given,
    each tensor is read to ``device`` (default CPU) and cast to ``dtype`` there as it
    arrives. ``progress`` draws a bytes bar on stderr when it is a terminal,
    ``force_progress`` always; either ends with a line such as ``loaded 16.1 GB in
    12.3 s (1.31 GB/s) from 4 shards``.

    ``quant``: the checkpoint's FP8 or 4-bit scheme
    (checkpoint_quant.parse_quantization_config); each float8 weight or 4-bit module comes
    back dequantised, in ``dtype`` or else bfloat16: a 4-bit layer linear weight in a
    LazyWeights, made from its groups when first read (``load_safetensors_tensors``).
    """
    return load_safetensors_tensors(model_dir, cfg, device, dtype, progress, force_progress, quant)[
        0
    ]


def load_safetensors_tensors(
    model_dir: Path,
    cfg: ModelConfig,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    progress: bool = False,
    force_progress: bool = False,
    quant: CheckpointQuant | Int4Quant | None = None,
) -> tuple[MutableMapping[str, torch.Tensor], dict[str, GroupQuant], Fp8Blocks | None]:
    """``load_safetensors_weights``'s weights, and with a 4-bit ``quant`` each layer linear
    weight stored in 4 bits as a GroupQuant of its bits (our names, on the device the
    tensors were read to: ``device``, else the CPU); {} for any other checkpoint. Third, an
    FP8 checkpoint's block scales of its layer linear weights (None without block scales).

    The weights are a dict, but where some layer linear weight is stored in 4 bits: then a
    LazyWeights whose entry for each such weight is made from its GroupQuant (the same one
    returned) when first read, so loading holds the groups and not also their dense copies
    (each module's packed tensors and its decoding are the only transient)."""
    source = str(model_dir)
    files = safetensors_files(model_dir)
    plan = _plan(files, cfg, source, quant)
    side_names = {o for _, named in plan for _, o in named if o and _weight_of(o) is not None}
    # Float8 weights, their scales and 4-bit modules' tensors are read as they are (a scale
    # cast to bf16 would lose bits, an int32 word all of them) and leave `pending` once a
    # weight's are all in, which may be in different shards.
    raw = frozenset(side_names | {w for o in side_names if (w := _weight_of(o)) is not None})
    modules = _packed_modules(plan) if isinstance(quant, Int4Quant) else {}
    order = [
        o if o not in side_names else o.removesuffix(".qweight")
        for _, named in plan
        # In the order safetensors lists a file (by HF name), as before, whichever path
        # read it: files are read in offset order. A 4-bit weight is where its qweight is.
        for _, o in sorted(named, key=lambda x: x[0].name)
        if o and (o not in side_names or o.endswith(".qweight"))
    ]
    total = sum(e.nbytes for _, named in plan for e, _ in named)
    target = None if device is None and dtype is None else _resolve(device)
    done: dict[str, torch.Tensor | DenseSource] = {}
    pending: Weights = {}
    groups: dict[str, GroupQuant] = {}
    block_scales: dict[str, torch.Tensor] = {}
    wanted = progress_wanted(progress, force_progress)
    with ByteProgress(total, f"loading {model_dir.name}", wanted) as bar:
        reader = None
        if target is not None:
            largest = max((e.nbytes for _, named in plan for e, _ in named), default=0)
            reader = _StagedReader(target, max(1, min(STAGE_BYTES, largest)))
        for k, (path, named) in enumerate(plan):
            bar.note(f"shard {k + 1}/{len(plan)}")
            if reader is None:
                got = _load_mapped(path, named, bar.update)
            else:
                got = _load_to(path, named, reader, dtype, bar.update, raw)
            pending |= {o: got.pop(o) for o in raw & got.keys()}
            done |= got
            if isinstance(quant, CheckpointQuant):
                done |= _dequantize_ready(pending, quant, dtype, block_scales)
            elif isinstance(quant, Int4Quant):
                done |= _decode_ready(pending, quant, dtype, modules, groups, source)
        assert not pending, sorted(pending)  # _plan paired every weight with its scales
        lazy = LazyWeights({o: done.pop(o) for o in order})
        # A plain dict where nothing is left to make, as every other checkpoint loads.
        weights = lazy if lazy.unread() else dict(lazy)
        if target is not None and target.type == "cuda":
            torch.cuda.synchronize(target)  # the copies are asynchronous: time them all
        checked = check_weights(weights, cfg, source=source)
        bar.finish(len(files))
    blocks = None
    if block_scales and isinstance(quant, CheckpointQuant) and quant.block is not None:
        blocks = Fp8Blocks(quant.block[0], quant.block[1], block_scales)
    return checked, groups, blocks


def check_group_indices(model_dir: Path, quant: Int4Quant) -> None:
    """UnsupportedQuantizationError naming the first GPTQ module whose g_idx is act-order's
    (not arange(in) // group): read before the memory plan and any weight, since a config's
    desc_act alone does not say (g_idx is one integer an input column: a few MB)."""
    if quant.method != "gptq":
        return
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        entries = [e for e in read_header(path) if e.name.endswith(".g_idx")]
        if not entries:
            continue
        with safe_open(str(path), framework="pt") as f:
            for e in entries:
                cols = e.shape[0] if len(e.shape) == 1 else 0
                if not cols or (quant.group != -1 and cols % quant.group):
                    continue  # misshaped: _plan names it with the module's other tensors
                if not gptq_trivial_g_idx(f.get_tensor(e.name), cols, quant.group):
                    raise UnsupportedQuantizationError(
                        f"{model_dir}: checkpoint quantization 'gptq' with act-order "
                        f"(desc_act: {e.name} is not arange(in) // group) is not supported; "
                        "supported: GPTQ quantised with desc_act=false"
                    )


def _resolve(device: torch.device | str | None) -> torch.device:
    d = torch.device(device if device is not None else "cpu")
    if d.type == "cuda" and d.index is None:
        # One concrete device, so streams, events and the final sync all name the same one.
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _load_mapped(
    path: Path, named: list[tuple[TensorEntry, str | None]], on_bytes: Callable[[int], None]
) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        for e, ours in named:
            if ours is not None:
                out[ours] = f.get_tensor(e.name)
            on_bytes(e.nbytes)
    return out


def _load_to(
    path: Path,
    named: list[tuple[TensorEntry, str | None]],
    reader: _StagedReader,
    dtype: torch.dtype | None,
    on_bytes: Callable[[int], None],
    raw: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """The file's tensors on the reader's device, cast to ``dtype`` except those ``raw``
    names (float8 weights and their scales, dequantised by the caller)."""
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb", buffering=0) as fh:
        if hasattr(os, "posix_fadvise"):
            # Tensors are read in file order: let the kernel read further ahead.
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for e, ours in named:
            if ours is None:
                on_bytes(e.nbytes)
                continue
            t = reader.read(fh, path, e, on_bytes)
            keep = dtype is None or dtype == t.dtype or ours in raw
            out[ours] = t if keep else t.to(dtype)
    return out


def cast_weights(weights: Weights, dtype: torch.dtype, device: torch.device | str) -> Weights:
    """Every tensor in ``dtype`` on ``device``; the input dict is emptied as it goes so a
    large CPU copy is not held twice. Tensors already there are passed through as they are.
    A LazyWeights (a GGUF's, an AWQ/GPTQ checkpoint's) stays one: its unread layer matrices
    are cast when read (the monokernel, streaming their groups, never reads them;
    weights/lazy_weights.py)."""
    return cast_mapping(weights, dtype, device, consume=True)  # type: ignore[return-value]
