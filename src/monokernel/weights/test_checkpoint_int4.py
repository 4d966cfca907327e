"""4-bit checkpoints (AWQ, GPTQ): tiny random bf16 checkpoints quantised and packed here as
AutoAWQ and AutoGPTQ / GPTQModel write them, then read back through load_checkpoint: the
same 4-bit values in ``Checkpoint.groups``, their dense values in ``Checkpoint.weights``
(made only when read, to the bit what the loader made at once before), and every malformed
or unsupported one refused by name."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from monokernel.errors import (
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
    WeightLoadError,
)
from monokernel.models.config import ModelConfig
from monokernel.models.shapes import DENSE_SHAPES
from monokernel.testing.checkpoint_files import save_checkpoint_tensors
from monokernel.weights.checkpoint_quant import (
    PACKED_PARTS,
    Int4Quant,
    decode_int4,
    parse_quantization_config,
)
from monokernel.weights.group_quant import GroupQuant
from monokernel.weights.lazy_weights import DenseSource, LazyWeights, cast_mapping
from monokernel.weights.loader import Checkpoint, load_checkpoint
from monokernel.weights.names import Weights, hf_to_ours, ours_to_hf
from monokernel.weights.quantize import UnsupportedQuantizationError, is_quantized
from monokernel.weights.random_checkpoint import write_random_checkpoint
from monokernel.weights.safetensors_loader import SINGLE_FILE, cast_weights

# Every optional tensor (q/k norms, q/k/v and o biases, an untied head), in two sizes: one
# whose input sizes 128 divides (the real group size), one that only 32 divides.
SHAPES: dict[str, tuple[ModelConfig, int]] = {
    "group128": (
        dataclasses.replace(
            DENSE_SHAPES["odd"],
            hidden_size=256,
            intermediate_size=384,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
        ),
        128,
    ),
    "group32-odd": (
        dataclasses.replace(
            DENSE_SHAPES["odd"],
            hidden_size=160,
            intermediate_size=224,
            num_layers=3,
            num_heads=5,
            num_kv_heads=1,
            head_dim=32,
        ),
        32,
    ),
}
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i holds column order[i] of 8
Stored = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q [out, in], z, fp16 s [out, in/g]


@pytest.fixture(scope="module", params=list(SHAPES))
def source(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Weights, int]:
    shape, group = SHAPES[request.param]
    out = tmp_path_factory.mktemp(request.param) / "bf16"
    return out, write_random_checkpoint(out, shape, seed=3, vocab_from_tokenizer=True), group


# -- the publishers' quantisers and packings, written apart from the loader -----------------


def quantize(w: torch.Tensor, group: int, kind: str, zmin: int = 0) -> Stored:
    """AWQ's min-max (``awq``), GPTQ's range through zero (``asym``) or GPTQ's symmetric
    (``sym``) 4-bit quantisation, one fp16 scale and one zero point per group."""
    out, cols = w.shape
    wg = w.float().reshape(out, cols // group, group)
    mn, mx = wg.amin(dim=2), wg.amax(dim=2)
    if kind == "sym":
        amax = torch.maximum(mn.abs(), mx)
        s = (2 * amax / 15).half()
        z = torch.full_like(mn, 8.0)
    else:
        if kind == "asym":
            mn, mx = mn.clamp(max=0), mx.clamp(min=0)
        s = ((mx - mn).clamp(min=1e-5) / 15).half()
        z = (-torch.round(mn / s.float())).clamp(zmin, 15)
    q = (torch.round(wg / s.float()[..., None]) + z[..., None]).clamp(0, 15)
    return q.reshape(out, cols).long(), z.long(), s


def words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 -> int32 [...], nibble i in bits 4i..4i+3."""
    acc = torch.zeros(nibbles.shape[:-1], dtype=torch.int64)
    for i in range(8):
        acc |= nibbles[..., i].long() << (4 * i)
    return torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32)


def pack_awq(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> dict[str, torch.Tensor]:
    order = list(AWQ_PACK_ORDER)

    def pack(t: torch.Tensor) -> torch.Tensor:  # [rows, out] -> [rows, out/8]
        return words(t.reshape(t.shape[0], -1, 8)[:, :, order])

    return {"qweight": pack(q.t()), "qzeros": pack(z.t()), "scales": s.t().contiguous()}


def pack_gptq(q: torch.Tensor, zstored: torch.Tensor, s: torch.Tensor) -> dict[str, torch.Tensor]:
    out, cols = q.shape
    qweight = words(q.t().reshape(cols // 8, 8, out).permute(0, 2, 1))  # input rows 8k + i
    qzeros = words(zstored.t().reshape(zstored.shape[1], out // 8, 8))  # output columns
    return {"qweight": qweight, "qzeros": qzeros, "scales": s.t().contiguous()}


@dataclasses.dataclass(frozen=True)
class Scheme:
    config: dict[str, Any]
    kind: str  # the quantiser: awq | asym | sym
    v1: bool = False  # GPTQ: zeros stored minus one
    g_idx: bool = False  # GPTQ: write the (trivial) g_idx


def awq_config(group: int, **more: Any) -> dict[str, Any]:
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    } | more


def gptq_config(group: int, sym: bool, fmt: str | None = "gptq", **more: Any) -> dict[str, Any]:
    config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "desc_act": False,
        "sym": sym,
        "damp_percent": 0.01,
        "true_sequential": True,
    } | more
    if fmt is not None:
        config["checkpoint_format"] = fmt
    return config


def schemes(group: int) -> dict[str, Scheme]:
    return {
        "awq": Scheme(awq_config(group), "awq"),
        "gptq-sym-v1": Scheme(gptq_config(group, True), "sym", v1=True, g_idx=True),
        "gptq-asym-v1": Scheme(gptq_config(group, False, None), "asym", v1=True),
        "gptq-asym-v2-desc-act": Scheme(
            gptq_config(group, False, "gptq_v2", desc_act=True), "asym", g_idx=True
        ),
    }


def write_int4(
    source: tuple[Path, Weights, int],
    dst: Path,
    scheme: Scheme,
    split: bool = False,
    plain: tuple[str, ...] = (),
    head: bool = False,
    edit: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> dict[str, Stored]:
    """``source`` with each layer matrix (and the LM head when ``head``) quantised and
    packed, except the modules of our names in ``plain``; the rest stays bf16. ``split``:
    the packed tensors but qweight in a second shard. ``edit`` may change the HF-named
    tensors before they are saved. Returns {our name: (q, z, s)}."""
    src, weights, group = source
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = scheme.config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    (dst / SINGLE_FILE).unlink()
    first: dict[str, torch.Tensor] = {}
    second: dict[str, torch.Tensor] = {}
    stored: dict[str, Stored] = {}
    for name, w in weights.items():
        hf = ours_to_hf(name)
        if not (is_quantized(name) or (head and name == "lm_head")) or name in plain:
            first[hf] = w
            continue
        q, z, s = quantize(w, group, scheme.kind, zmin=1 if scheme.v1 else 0)
        stored[name] = (q, z, s)
        packed = pack_awq(q, z, s) if scheme.kind == "awq" else pack_gptq(q, z - int(scheme.v1), s)
        if scheme.g_idx:
            packed["g_idx"] = torch.arange(w.shape[1], dtype=torch.int32) // group
        module = hf.removesuffix(".weight")
        for part, t in packed.items():
            tensor = t.contiguous()  # safetensors saves no views
            (second if split and part != "qweight" else first)[f"{module}.{part}"] = tensor
    save_checkpoint_tensors(dst, first, second, split, edit)
    return stored


def todays_dense(dst: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each 4-bit module of ``dst`` as the loader made it at load before its layer matrices
    were left as their groups (decode_int4, then dense in the load's dtype, bfloat16 when
    none): the reference a matrix read from the loaded weights must equal to the bit."""
    from safetensors.torch import load_file

    config = json.loads((dst / "config.json").read_text())
    quant = parse_quantization_config(config)
    assert isinstance(quant, Int4Quant)
    tensors = {k: v for f in sorted(dst.glob("*.safetensors")) for k, v in load_file(f).items()}
    out: dict[str, torch.Tensor] = {}
    for hf in tensors:
        module, _, part = hf.rpartition(".")
        if part == "qweight":
            parts = {
                p: tensors[f"{module}.{p}"] for p in PACKED_PARTS if f"{module}.{p}" in tensors
            }
            ours = hf_to_ours(module + ".weight")
            assert ours is not None, hf
            out[ours] = decode_int4(parts, quant).dense(dtype)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit (torch.equal takes -0.0 for 0.0), in the same dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


@pytest.fixture()
def made(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every dense matrix made from groups, as "Class.method(shape)", in order: a
    DenseSource's, and GroupQuant's own (which the loader called at once before)."""
    calls: list[str] = []
    for cls, attr in ((DenseSource, "dense"), (GroupQuant, "dense"),
                      (GroupQuant, "zero_point_dense")):  # fmt: skip
        real = getattr(cls, attr)

        def counted(self: Any, *args: Any, _real: Any = real, _what: str = attr) -> Any:
            calls.append(f"{type(self).__name__}.{_what}{tuple(self.shape)}")
            return _real(self, *args)

        monkeypatch.setattr(cls, attr, counted)
    return calls


def expected(stored: Stored, group: int) -> torch.Tensor:
    """s * (q - z) in float64 (exact there), then float32 (exact too: 11 + 5 bits)."""
    q, z, s = stored
    return (
        s.double().repeat_interleave(group, 1)
        * (q.double() - z.double().repeat_interleave(group, 1))
    ).float()


# -- quantization_config ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "want"),
    [
        (awq_config(128), Int4Quant("awq", 128)),
        ({"quant_method": "awq", "w_bit": 4, "q_group_size": 64}, Int4Quant("awq", 64)),
        (gptq_config(128, True), Int4Quant("gptq", 128, True, "gptq")),
        (gptq_config(-1, False, None), Int4Quant("gptq", -1, False, "gptq")),
        (
            gptq_config(32, False, None, format="gptq_v2", desc_act=True),
            Int4Quant("gptq", 32, False, "gptq_v2", True),
        ),
    ],
)
def test_int4_schemes(config: dict[str, Any], want: Int4Quant) -> None:
    assert parse_quantization_config({"quantization_config": config}) == want


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (awq_config(128, version="gemv"), "version 'gemv'"),
        (awq_config(128, version="GEMV_fast"), "version 'gemv_fast'"),
        (awq_config(128, bits=8), "bits=8"),
        (awq_config(128, zero_point=False), "zero_point=false"),
        (awq_config(48), "group_size=48"),
        (awq_config(-1), "group_size=-1"),
        (awq_config(128, backend="llm-awq"), "backend 'llm-awq'"),
        (gptq_config(128, True, bits=3), "bits=3"),
        (gptq_config(128, True, "marlin"), "checkpoint_format 'marlin'"),
        (gptq_config(128, True, is_marlin_format=True), "checkpoint_format 'marlin'"),
        (gptq_config(128, True, dynamic={"-:.*down": {}}), "dynamic"),
        (gptq_config(100, True), "group_size=100"),
        (gptq_config(128, True, pack_dtype="int16"), "pack_dtype 'int16'"),
    ],
)
def test_other_int4_schemes_are_refused(config: dict[str, Any], says: str) -> None:
    with pytest.raises(UnsupportedQuantizationError) as e:
        parse_quantization_config({"quantization_config": config})
    message = str(e.value)
    method = config["quant_method"]
    assert message.startswith(f"checkpoint quantization {method!r} (") and says in message
    assert "supported: fp8" in message and "awq (4-bit" in message and "gptq (4-bit" in message


# -- through the loader ------------------------------------------------------------------


def assert_loads(
    dst: Path, stored: dict[str, Stored], source: tuple[Path, Weights, int], head: bool = False
) -> None:
    _, weights, group = source
    ckpt = load_checkpoint(dst, progress=False, dtype=torch.float32)
    mapped = load_checkpoint(dst, progress=False)  # memory-mapped: bf16 for the 4-bit ones
    assert ckpt.quantization == mapped.quantization == "int4"
    assert ckpt.groups is not None and mapped.groups is not None
    assert set(ckpt.groups) == {n for n in weights if is_quantized(n)} == set(mapped.groups)
    assert set(ckpt.weights) == set(weights) == set(mapped.weights)
    # The layer matrices are their groups until read, then what the loader made before.
    for loaded, dtype in ((ckpt, torch.float32), (mapped, torch.bfloat16)):
        assert isinstance(loaded.weights, LazyWeights)
        assert sorted(loaded.weights.unread()) == sorted(ckpt.groups)
        for n, want in todays_dense(dst, dtype).items():
            assert same_bits(loaded.weights[n], want), n
    for n, w in weights.items():
        got, view = ckpt.weights[n], mapped.weights[n]
        assert got.dtype == torch.float32, n
        if n not in stored:  # embed, norms, biases, an unquantised head: as they were
            assert torch.equal(got, w.float()) and torch.equal(view, w), n
            continue
        want = expected(stored[n], group)
        assert torch.equal(got, want), n
        assert view.dtype == torch.bfloat16 and torch.equal(view, want.bfloat16()), n
        # A checkpoint of the weights, not only of itself: within a step of each.
        step = stored[n][2].float().abs().repeat_interleave(group, 1)
        assert bool(((got - w.float()).abs() <= step * 1.01).all()), n
        if n == "lm_head":
            assert head and n not in ckpt.groups
            continue
        q, z, s = stored[n]
        for gq in (ckpt.groups[n], mapped.groups[n]):
            assert gq.group == group and gq.q.device.type == "cpu", n
            assert torch.equal(gq.q, q.to(torch.uint8)), n
            assert torch.equal(gq.scale, s.float()), n
            assert torch.equal(gq.offset, (-z.double() * s.double()).float()), n
            assert torch.equal(gq.dense(), got), n


@pytest.mark.parametrize("name", ["awq", "gptq-sym-v1", "gptq-asym-v1", "gptq-asym-v2-desc-act"])
def test_loads_the_4bit_values(
    source: tuple[Path, Weights, int], tmp_path: Path, name: str
) -> None:
    scheme = schemes(source[2])[name]
    stored = write_int4(source, tmp_path / name, scheme)
    assert_loads(tmp_path / name, stored, source)


@pytest.mark.parametrize("name", ["awq", "gptq-sym-v1"])
def test_the_config_announces_its_groups_before_any_weight(
    source: tuple[Path, Weights, int], tmp_path: Path, name: str
) -> None:
    """The loader's hook hears the method and group width from config.json before any
    weight is read, and the engine's plan from that is the one it makes from the loaded
    groups (so it need not count bf16 layers first: a 32B AWQ fits where those do not)."""
    from monokernel.runtime.memory_plan import announced_packing, layer_packing
    from monokernel.weights.loader import Announced, run_formats

    write_int4(source, tmp_path / name, schemes(source[2])[name])
    heard: list[Announced] = []
    ckpt = load_checkpoint(
        tmp_path / name, progress=False, dtype=torch.float32,
        before_weights=lambda _cfg, a: heard.append(a),
    )  # fmt: skip
    assert heard == [Announced("int4", source[2])]
    assert ckpt.quantization == heard[0].quantization
    for quantize in (None, "int4", "fp8"):
        loaded = layer_packing(ckpt.config, run_formats(ckpt, quantize))
        assert announced_packing(ckpt.config, quantize, heard[0], 1, False) == loaded, quantize


def test_packed_tensors_in_another_shard(source: tuple[Path, Weights, int], tmp_path: Path) -> None:
    stored = write_int4(source, tmp_path / "awq", schemes(source[2])["awq"], split=True)
    assert_loads(tmp_path / "awq", stored, source)
    # The order is the bf16 loader's: each weight where its qweight is listed.
    plain = load_checkpoint(source[0], progress=False)
    assert list(load_checkpoint(tmp_path / "awq", progress=False).weights) == list(plain.weights)


def test_a_quantised_lm_head_is_dense_only(
    source: tuple[Path, Weights, int], tmp_path: Path
) -> None:
    group = source[2]
    scheme = Scheme(gptq_config(group, True, lm_head=True), "sym", v1=True)
    stored = write_int4(source, tmp_path / "head", scheme, head=True)
    assert "lm_head" in stored
    assert_loads(tmp_path / "head", stored, source, head=True)


def test_a_module_left_unquantised(source: tuple[Path, Weights, int], tmp_path: Path) -> None:
    """modules_to_not_convert: that weight loads as it was; the model is not all 4-bit, so
    the engine is not told to stream it as such."""
    _, weights, group = source
    config = awq_config(group, modules_to_not_convert=["model.layers.1.mlp.down_proj"])
    stored = write_int4(source, tmp_path / "awq", Scheme(config, "awq"), plain=("layers.1.w_down",))
    ckpt = load_checkpoint(tmp_path / "awq", progress=False, dtype=torch.float32)
    assert ckpt.quantization is None and ckpt.groups is None
    # Its 4-bit layer matrices are still made only when read (the engines read them all).
    assert isinstance(ckpt.weights, LazyWeights)
    assert sorted(ckpt.weights.unread()) == sorted(set(stored) - {"lm_head"})
    assert torch.equal(ckpt.weights["layers.1.w_down"], weights["layers.1.w_down"].float())
    assert torch.equal(ckpt.weights["layers.0.w_down"], expected(stored["layers.0.w_down"], group))


def test_a_config_left_over_on_bf16_weights(
    source: tuple[Path, Weights, int], tmp_path: Path
) -> None:
    """A checkpoint converted back to bf16 that kept its AWQ quantization_config loads as
    bf16: no module is 4-bit, so neither are the model's groups."""
    src, weights, group = source
    shutil.copytree(src, tmp_path / "bf16")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config["quantization_config"] = awq_config(group)
    (tmp_path / "bf16" / "config.json").write_text(json.dumps(config))
    ckpt = load_checkpoint(tmp_path / "bf16", progress=False)
    assert ckpt.quantization is None and ckpt.groups is None
    assert type(ckpt.weights) is dict  # nothing to make: as any bf16 checkpoint loads
    assert all(torch.equal(ckpt.weights[n], w) for n, w in weights.items())


def test_act_order_is_refused_before_any_weight(
    source: tuple[Path, Weights, int], tmp_path: Path
) -> None:
    group = source[2]
    scheme = Scheme(gptq_config(group, False, desc_act=True), "asym", v1=True, g_idx=True)
    name = "model.layers.1.self_attn.o_proj.g_idx"

    def act_order(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name].flip(0).contiguous()

    write_int4(source, tmp_path / "gptq", scheme, edit=act_order)

    def before(*_: object) -> None:
        raise AssertionError("the memory plan ran for a checkpoint that cannot load")

    with pytest.raises(UnsupportedQuantizationError, match=rf"act-order \(desc_act: {name}"):
        load_checkpoint(tmp_path / "gptq", progress=False, before_weights=before)


# -- the layer matrices stay their groups until read ------------------------------------------

# How load_checkpoint is called: as the engine on a GPU (bf16) and on the CPU (float32), both
# read to a device, and memory-mapped (no device, no dtype: bf16 for the 4-bit modules).
LOADS: dict[str, tuple[str | None, torch.dtype | None]] = {
    "bf16": ("cpu", torch.bfloat16),
    "float32": ("cpu", torch.float32),
    "mapped": (None, None),
}


@pytest.mark.parametrize("load", list(LOADS))
@pytest.mark.parametrize("name", ["awq", "gptq-asym-v1"])
def test_loading_makes_no_layer_matrix_dense(
    source: tuple[Path, Weights, int], tmp_path: Path, made: list[str], name: str, load: str
) -> None:
    """The loader decodes each module to its groups and stops there: a 32B model's 65 GB of
    bf16 layers are never made beside its groups. Reading a matrix makes it once, to the
    bit what the loader made at once before."""
    device, dtype = LOADS[load]
    dst = tmp_path / name
    write_int4(source, dst, schemes(source[2])[name])
    ckpt = load_checkpoint(dst, progress=False, device=device, dtype=dtype)
    assert made == []
    assert ckpt.groups is not None and isinstance(ckpt.weights, LazyWeights)
    assert sorted(ckpt.weights.unread()) == sorted(ckpt.groups)
    for n, gq in ckpt.groups.items():
        assert ckpt.weights.shape(n) == torch.Size(gq.shape), n
    want = todays_dense(dst, dtype or torch.bfloat16)
    for n in ckpt.groups:
        got = ckpt.weights[n]
        assert same_bits(got, want[n]) and ckpt.weights[n] is got, n  # made once, then kept
    assert [m for m in made if m.startswith("DenseSource")] == [
        f"DenseSource.dense{ckpt.groups[n].shape}" for n in ckpt.groups
    ]
    assert ckpt.weights.unread() == []


def test_a_cast_leaves_them_unread_and_rounds_as_a_tensor_would(
    source: tuple[Path, Weights, int], tmp_path: Path, made: list[str]
) -> None:
    """The engine's cast_weights and the backends' cast_mapping keep the matrices unread; read
    after a cast, a matrix is what casting its dense values gives, roundings included: bf16
    (a GPU's load) cast to float32 keeps bf16's values."""
    dst = tmp_path / "awq"
    write_int4(source, dst, schemes(source[2])["awq"])
    f32 = load_checkpoint(dst, progress=False, device="cpu", dtype=torch.float32)
    bf16 = load_checkpoint(dst, progress=False, device="cpu", dtype=torch.bfloat16)
    assert f32.groups is not None
    layers = sorted(f32.groups)
    half = cast_mapping(f32.weights, torch.bfloat16)  # the monokernel backend's copy
    widened = cast_mapping(bf16.weights, torch.float32, "cpu")
    engine = cast_weights(bf16.weights, torch.bfloat16, "cpu")  # Engine.__init__, consuming
    assert len(bf16.weights) == 0 and made == []
    for w in (f32.weights, half, widened, engine):
        assert isinstance(w, LazyWeights) and sorted(w.unread()) == layers
    todays = {dtype: todays_dense(dst, dtype) for dtype in (torch.float32, torch.bfloat16)}
    for n in layers:
        assert same_bits(half[n], todays[torch.float32][n].to(torch.bfloat16)), n
        assert same_bits(widened[n], todays[torch.bfloat16][n].to(torch.float32)), n
        assert same_bits(engine[n], todays[torch.bfloat16][n]), n
    assert sorted(f32.weights.unread()) == layers  # each cast made its own


def _logits(ckpt_or_dir: Checkpoint | Path, engine: str, ids: list[int]) -> torch.Tensor:
    from monokernel.runtime.engine import Engine, EngineConfig

    config = EngineConfig(engine=engine, device="cpu", max_model_len=64, progress=False)
    eng = Engine(ckpt_or_dir, config)
    return eng.backend._forward(ids, 0)  # type: ignore[attr-defined]


@pytest.mark.parametrize("engine", ["reference", "torch"])
@pytest.mark.parametrize("name", ["awq", "gptq-sym-v1"])
def test_the_dense_engines_compute_as_before(
    source: tuple[Path, Weights, int], tmp_path: Path, name: str, engine: str
) -> None:
    """An engine that computes with dense matrices gets the same logits from the checkpoint
    as from the dense matrices the loader made at load before (the same bits)."""
    dst = tmp_path / name
    write_int4(source, dst, schemes(source[2])[name])
    ids = [int(i) for i in torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(7))]
    lazy = _logits(dst, engine, ids)  # the engine loads it: float32 on the CPU
    ckpt = load_checkpoint(dst, progress=False, device="cpu", dtype=torch.float32)
    todays = todays_dense(dst, torch.float32)
    dense = {n: todays[n] if n in todays else ckpt.weights[n] for n in ckpt.weights}
    before = _logits(dataclasses.replace(ckpt, weights=dense), engine, ids)
    assert lazy.shape[-1] == ckpt.config.vocab_size and same_bits(lazy, before)


def test_the_monokernel_reads_no_layer_matrix(
    source: tuple[Path, Weights, int],
    tmp_path: Path,
    made: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the engine builds the monokernel on a GPU, up to the KV cache, on the CPU (the
    kernel build, the device and its free memory stood in for): it packs the checkpoint's own
    groups and makes no layer matrix dense, not even for a moment."""
    from monokernel.testing.backend_on_cpu import repacked_on_cpu, stop_at_the_cache
    from monokernel.weights.loader import run_formats
    from monokernel.weights.quantize import groups_stream

    dst = tmp_path / "awq"
    write_int4(source, dst, schemes(source[2])["awq"])
    ckpt = load_checkpoint(dst, progress=False, device="cpu", dtype=torch.bfloat16)
    formats = run_formats(ckpt, None)
    assert formats.quantize == "int4" and formats.groups is not None
    if not groups_stream(ckpt.config, formats.groups):
        pytest.skip("this shape's groups do not stream on the monokernel")

    stop_at_the_cache(monkeypatch)
    weights = cast_weights(ckpt.weights, torch.bfloat16, "cpu")
    packed = repacked_on_cpu(ckpt.config, weights, formats.quantize, formats.groups)
    assert made == []
    assert not any(k.startswith("layers.") and k in ckpt.groups for k in weights)  # consumed
    assert len(packed.layers) == ckpt.config.num_layers
    assert {m.format for lp in packed.layers for m in lp.matrices.values()} <= {"int4"}


# -- malformed checkpoints, refused from the headers ------------------------------------------


Edit = Callable[[dict[str, torch.Tensor]], None]
MODULE = "model.layers.0.mlp.up_proj"


def _pop(part: str) -> Edit:
    return lambda t: t.pop(f"{MODULE}.{part}")


def _set(part: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Edit:
    return lambda t: t.update({f"{MODULE}.{part}": make(t[f"{MODULE}.{part}"])})


@pytest.mark.parametrize(
    ("edit", "error", "says"),
    [
        (_pop("qzeros"), MissingTensorError, rf"{MODULE} has no {MODULE}\.qzeros"),
        (
            _set("scales", lambda s: s[:, :-8].contiguous()),
            TensorShapeError,
            rf"{MODULE}\.scales has shape",
        ),
        (_set("qzeros", lambda z: z[:-1]), TensorShapeError, rf"{MODULE}\.qzeros has shape"),
        (_set("qweight", lambda q: q.float()), WeightLoadError, r"qweight is torch\.float32"),
        (_set("qweight", lambda q: q[:-8]), TensorShapeError, r"qweight of shape"),
        (
            lambda t: t.update({f"{MODULE}.weight": torch.zeros(2, 2)}),
            UnexpectedTensorError,
            rf"{MODULE} has both a weight and 4-bit tensors",
        ),
        (
            lambda t: t.update({f"{MODULE}.g_idx": torch.zeros(2, dtype=torch.int32)}),
            UnexpectedTensorError,
            r"g_idx in an AWQ checkpoint",
        ),
    ],
)
def test_malformed_awq_modules(
    source: tuple[Path, Weights, int],
    tmp_path: Path,
    edit: Edit,
    error: type[Exception],
    says: str,
) -> None:
    write_int4(source, tmp_path / "awq", schemes(source[2])["awq"], edit=edit)
    with pytest.raises(error, match=says):
        load_checkpoint(tmp_path / "awq", progress=False)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["awq", "gptq-asym-v1"])
def test_a_4bit_checkpoint_streams_its_groups_on_the_monokernel(
    name: str, source: tuple[Path, Weights, int], tmp_path: Path
) -> None:
    """An AWQ or GPTQ checkpoint on the GPU: the monokernel packs the checkpoint's own groups
    as int4 (no re-quantisation) and its teacher-forced logits are the float32 reference's
    on the checkpoint's dequantised values."""
    from monokernel.testing.gpu_models import hopper_with, random_ids
    from monokernel.testing.oracle import assert_logits_match

    if not hopper_with(8):
        pytest.skip("needs a Hopper GPU")
    if source[2] != 128:
        pytest.skip("the group-128 shape (AWQ's and GPTQ's usual group)")
    from monokernel.runtime.backends.monokernel import MonokernelBackend

    dst = tmp_path / name
    write_int4(source, dst, schemes(128)[name])
    ckpt = load_checkpoint(dst, progress=False, dtype=torch.float32)
    assert ckpt.quantization == "int4" and ckpt.groups is not None
    cfg, dev = ckpt.config, torch.device("cuda")
    # As the engine hands them over: cast, the layer matrices unread (and left so).
    lazy = cast_mapping(ckpt.weights, torch.bfloat16, dev)
    prompt, steps = 32, 64
    seq = random_ids(prompt + steps, cfg.vocab_size, seed=5)
    mk = MonokernelBackend(
        cfg, lazy, prompt + steps, dev, quantize="int4", groups=ckpt.groups,
        prefill_precision="fp32",
    )  # fmt: skip
    assert isinstance(lazy, LazyWeights) and sorted(lazy.unread()) == sorted(ckpt.groups)
    dense = {k: v.to(dev) for k, v in ckpt.weights.items()}
    try:
        packed = mk.kernel.packed.layers[0].matrices["wo"]
        assert packed.format == "int4" and packed.scales[0].shape[1] == cfg.q_size // 128
        got = mk.teacher_forced_logits(seq[:prompt], seq[prompt:])
    finally:
        mk.close()
    assert_logits_match(cfg, dense, seq, prompt, got, f"{name} checkpoint int4")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["awq", "gptq-asym-v1"])
def test_a_4bit_checkpoint_loads_to_the_gpu_as_its_groups(
    name: str, source: tuple[Path, Weights, int], tmp_path: Path
) -> None:
    """Read to the GPU as the engine reads it (bf16): the device holds the groups and the
    other tensors, never the layers' dense bf16 beside them (a 32B model's 65 GB), and at
    the peak of the load one module's decoding more."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dst = tmp_path / name
    write_int4(source, dst, schemes(source[2])[name])
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    ckpt = load_checkpoint(dst, progress=False, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    held = torch.cuda.memory_allocated(dev) - base
    assert ckpt.groups is not None and isinstance(ckpt.weights, LazyWeights)
    assert sorted(ckpt.weights.unread()) == sorted(ckpt.groups)
    gqs = list(ckpt.groups.values())
    assert all(gq.q.device == dev for gq in gqs)
    groups = sum(t.nbytes for gq in gqs for t in (gq.q, gq.scale, gq.offset))
    rest = sum(ckpt.weights[n].nbytes for n in ckpt.weights if n not in ckpt.groups)
    dense_layers = 2 * sum(gq.q.numel() for gq in gqs)
    slack = 256 << 10  # the allocator's rounding of each of a few hundred tensors
    assert groups + rest <= held <= groups + rest + slack
    # Decoding a module takes ~8.5 bytes a weight of it (int32 nibbles, their mask, uint8).
    largest = max(gq.q.numel() for gq in gqs)
    assert peak <= held + 10 * largest + slack < held + dense_layers
    # Reading one makes it there, the bits of the CPU's decoding.
    n = "layers.0.w_up"
    cpu = todays_dense(dst, torch.bfloat16)[n]
    assert same_bits(ckpt.weights[n].cpu(), cpu)
