"""FP8 checkpoints: the quantization_config schemes read and refused, dequantisation, and
tiny FP8 checkpoints (a random bf16 one rewritten as its publisher would) through the
loader and the engine."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from monokernel.errors import (
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
    WeightLoadError,
)
from monokernel.models.shapes import DENSE_SHAPES
from monokernel.testing.checkpoint_files import save_checkpoint_tensors
from monokernel.weights import safetensors_loader
from monokernel.weights.checkpoint_quant import (
    CheckpointQuant,
    dequantize,
    parse_quantization_config,
)
from monokernel.weights.formats import get_format
from monokernel.weights.loader import Announced, load_checkpoint
from monokernel.weights.names import Weights, ours_to_hf
from monokernel.weights.progress import ByteProgress
from monokernel.weights.quantize import UnsupportedQuantizationError, is_quantized
from monokernel.weights.random_checkpoint import write_random_checkpoint
from monokernel.weights.safetensors_loader import SINGLE_FILE, read_header

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
Quantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


# -- the publishers' quantisers, written apart from the loader ------------------------------


def q_channel(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """llm-compressor's / fbgemm's min-max: each row's amax onto 448; scale [out, 1]."""
    wf = w.float()
    s = (wf.abs().amax(dim=1, keepdim=True) / FP8_MAX).to(scale_dtype)
    return (wf / s.float()).clamp(-FP8_MAX, FP8_MAX).to(E4M3), s


def q_tensor(w: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    wf = w.float()
    s = wf.abs().amax() / FP8_MAX
    return (wf / s).clamp(-FP8_MAX, FP8_MAX).to(E4M3), s.reshape(shape)


def expand_blocks(s: torch.Tensor, bm: int, bn: int, out: int, inp: int) -> torch.Tensor:
    return s.float().repeat_interleave(bm, 0)[:out].repeat_interleave(bn, 1)[:, :inp]


def q_block(w: torch.Tensor, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' FineGrainedFP8: one amax / 448 a block (zero padding leaves amax)."""
    wf = w.float()
    out, inp = wf.shape
    nr, nc = math.ceil(out / bm), math.ceil(inp / bn)
    padded = torch.zeros(nr * bm, nc * bn)
    padded[:out, :inp] = wf
    s = padded.view(nr, bm, nc, bn).abs().amax(dim=(1, 3)) / FP8_MAX
    q = (wf / expand_blocks(s, bm, bn, out, inp)).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    return q, s


def ct_config(
    strategy: str, block: list[int] | None = None, bits: int = 8, kind: str = "float", **more: Any
) -> dict[str, Any]:
    """A compressed-tensors quantization_config as llm-compressor writes it."""
    weights = {
        "num_bits": bits,
        "type": kind,
        "strategy": strategy,
        "symmetric": True,
        "dynamic": False,
        "group_size": None,
        "block_structure": block,
        "observer": "minmax",
        "actorder": None,
    } | more
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized" if kind == "float" else "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "dynamic": True,
                    "symmetric": True,
                },
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


@dataclasses.dataclass(frozen=True)
class Scheme:
    config: dict[str, Any]
    suffix: str
    quantize: Quantizer
    block: tuple[int, int] | None = None
    # Also write static activation scales and FP8 KV-cache scales, which the loader skips.
    activation_tensors: bool = False


SCHEMES: dict[str, Scheme] = {
    "ct-channel": Scheme(ct_config("channel"), "weight_scale", q_channel),
    "ct-channel-bf16-scales": Scheme(
        ct_config("channel"), "weight_scale", lambda w: q_channel(w, torch.bfloat16)
    ),
    "fbgemm": Scheme(
        {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
        "weight_scale",
        q_channel,
    ),
    "ct-tensor-static": Scheme(
        ct_config("tensor"), "weight_scale", lambda w: q_tensor(w, (1,)), activation_tensors=True
    ),
    "autofp8-tensor": Scheme(
        {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
        "weight_scale",
        lambda w: q_tensor(w, ()),
        activation_tensors=True,
    ),
    # The odd shape's 520, 104 and 1400 leave a partial last block both ways.
    "hf-block": Scheme(
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]},
        "weight_scale_inv",
        lambda w: q_block(w, 16, 16),
        (16, 16),
    ),
    "ct-block": Scheme(
        ct_config("block", [32, 24]), "weight_scale", lambda w: q_block(w, 32, 24), (32, 24)
    ),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Weights]:
    out = tmp_path_factory.mktemp("bf16") / "ckpt"
    return out, write_random_checkpoint(
        out, DENSE_SHAPES["odd"], seed=11, vocab_from_tokenizer=True
    )


def _copy(src: Path, dst: Path, quantization_config: dict[str, Any] | None) -> None:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def write_fp8(
    source: tuple[Path, Weights],
    dst: Path,
    scheme: Scheme,
    split: bool = False,
    edit: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``source`` with each layer matrix as float8 + scale; the rest stays bf16. ``split``:
    the scales in a second shard (an index names both); ``edit`` may change the HF-named
    tensors before they are saved. Returns {our name: (q, scale)}."""
    src, weights = source
    _copy(src, dst, scheme.config)
    (dst / SINGLE_FILE).unlink()
    tensors: dict[str, torch.Tensor] = {}
    extra: dict[str, torch.Tensor] = {}
    stored: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, w in weights.items():
        hf = ours_to_hf(name)
        if not is_quantized(name):
            tensors[hf] = w
            continue
        q, s = scheme.quantize(w)
        stored[name] = (q, s)
        tensors[hf] = q
        module = hf.removesuffix(".weight")
        extra[f"{module}.{scheme.suffix}"] = s
        if scheme.activation_tensors:
            extra[f"{module}.input_scale"] = torch.tensor([0.02])
            if module.endswith("k_proj"):
                attn = module.removesuffix(".k_proj")
                extra |= {
                    f"{attn}.k_scale": torch.tensor(1.0),
                    f"{attn}.v_scale": torch.tensor(1.0),
                }
    save_checkpoint_tensors(dst, tensors, extra, split, edit)
    return stored


def expected(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """q * scale as each format defines it, in float32: its block's, the tensor's or the
    row's scale."""
    if block is not None:
        return q.float() * expand_blocks(s, *block, *q.shape)
    if s.numel() == 1:
        return q.float() * s.float().reshape(())
    return q.float() * s.float().reshape(-1, 1)


# -- quantization_config ---------------------------------------------------------------------


def test_no_quantization_config() -> None:
    assert parse_quantization_config({"model_type": "qwen3"}) is None


@pytest.mark.parametrize(
    ("config", "want"),
    [
        (
            {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
            },
            CheckpointQuant("fp8", "block", (128, 128), "weight_scale_inv", False),
        ),
        (
            {"quant_method": "fp8", "activation_scheme": "static"},
            CheckpointQuant("fp8", "tensor", None, "weight_scale", False),
        ),
        (
            {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
            CheckpointQuant("fbgemm_fp8", "channel", None, "weight_scale", False),
        ),
        (
            ct_config("channel"),
            CheckpointQuant("compressed-tensors", "channel", None, "weight_scale", False),
        ),
        (
            ct_config("tensor"),
            CheckpointQuant("compressed-tensors", "tensor", None, "weight_scale", False),
        ),
        (
            ct_config("block", [128, 128]),
            CheckpointQuant("compressed-tensors", "block", (128, 128), "weight_scale", False),
        ),
    ],
)
def test_supported_schemes(config: dict[str, Any], want: CheckpointQuant) -> None:
    assert parse_quantization_config({"quantization_config": config}) == want


def _refusal(config: dict[str, Any]) -> str:
    with pytest.raises(UnsupportedQuantizationError) as e:
        parse_quantization_config({"quantization_config": config})
    message = str(e.value)
    assert "\n" not in message and "supported: fp8" in message and "compressed-tensors" in message
    return message


@pytest.mark.parametrize("method", ["bitsandbytes", "mxfp4", "hqq", "torchao", "exl2"])
def test_other_methods_are_refused_by_name(method: str) -> None:
    message = _refusal({"quant_method": method, "bits": 4})
    assert message.startswith(f"checkpoint quantization {method!r} is not supported")
    assert "awq (4-bit" in message and "gptq (4-bit" in message
    four_bit = method in ("bitsandbytes", "hqq", "exl2")
    assert ("4-bit checkpoints are read in AWQ (GEMM) and GPTQ packing only" in message) == four_bit


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (
            ct_config("group", bits=4, kind="int", group_size=128),
            "num_bits=4 type=int strategy=group",
        ),
        (ct_config("channel", bits=8, kind="int"), "num_bits=8 type=int strategy=channel"),
        (ct_config("tensor_group", bits=4, kind="float"), "num_bits=4 type=float"),
        (ct_config("group", group_size=128), "num_bits=8 type=float strategy=group"),
        (ct_config("channel", symmetric=False), "asymmetric"),
        (ct_config("block", None), "block_structure=None"),
    ],
)
def test_other_compressed_tensors_schemes_are_refused(config: dict[str, Any], says: str) -> None:
    message = _refusal(config)
    assert "'compressed-tensors'" in message and says in message, message


def test_compressed_tensors_groups_must_agree() -> None:
    config = ct_config("channel")
    config["config_groups"]["group_1"] = ct_config("tensor")["config_groups"]["group_0"]
    assert "different weight schemes" in _refusal(config)


def test_refusals_of_malformed_configs() -> None:
    assert "without a quant_method" in _refusal({"bits": 8})
    assert "weight_block_size" in _refusal({"quant_method": "fp8", "weight_block_size": [128]})
    sparse = ct_config("channel") | {"sparsity_config": {"format": "sparse-24-bitmask"}}
    assert "sparse-24-bitmask" in _refusal(sparse)


# -- dequantize ------------------------------------------------------------------------------


def test_dequantize_each_strategy() -> None:
    torch.manual_seed(0)
    w = torch.randn(37, 29)
    q, s = q_channel(w)
    got = dequantize(q, s, CheckpointQuant("x", "channel", None, "weight_scale"))
    assert got.dtype == torch.float32 and torch.equal(got, q.float() * s)
    assert torch.equal(
        got, dequantize(q, s.reshape(-1), CheckpointQuant("x", "channel", None, "weight_scale"))
    )
    q, s = q_tensor(w, ())
    got = dequantize(q, s, CheckpointQuant("x", "tensor", None, "weight_scale"))
    assert torch.equal(got, q.float() * s)
    q, s = q_block(w, 8, 10)  # 37 = 4*8 + 5 rows, 29 = 2*10 + 9 columns
    assert tuple(s.shape) == (5, 3)
    got = dequantize(q, s, CheckpointQuant("x", "block", (8, 10), "weight_scale_inv"))
    want = torch.empty(37, 29)
    for r in range(37):
        for c in range(29):
            want[r, c] = q[r, c].float() * s[r // 8, c // 10]
    assert torch.equal(got, want)
    # Close to the weights: the scheme is right, not only self-consistent.
    assert (got - w).abs().max() <= w.abs().max() / 8


def test_dequantize_refuses_a_scale_that_does_not_fit() -> None:
    q = torch.zeros(40, 24).to(E4M3)
    block = CheckpointQuant("fp8", "block", (16, 16), "weight_scale_inv")
    with pytest.raises(
        TensorShapeError, match=r"wq\.weight_scale_inv.*\(3, 3\).*\(40, 24\).*\(3, 2\)"
    ):
        dequantize(q, torch.ones(3, 3), block, name="wq.weight_scale_inv")
    with pytest.raises(TensorShapeError, match=r"channel scale of shape \(24, 1\)"):
        dequantize(q, torch.ones(24, 1), CheckpointQuant("x", "channel", None, "weight_scale"))
    with pytest.raises(TensorShapeError, match=r"tensor scale of shape \(2,\)"):
        dequantize(q, torch.ones(2), CheckpointQuant("x", "tensor", None, "weight_scale"))


# -- FP8 checkpoints through the loader ------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEMES))
def test_loads_q_times_scale(source: tuple[Path, Weights], tmp_path: Path, name: str) -> None:
    _, weights = source
    scheme = SCHEMES[name]
    stored = write_fp8(source, tmp_path / "fp8", scheme)
    ckpt = load_checkpoint(tmp_path / "fp8", progress=False, dtype=torch.float32)
    assert ckpt.quantization == "fp8"
    assert set(ckpt.weights) == set(weights)
    mapped = load_checkpoint(tmp_path / "fp8", progress=False)  # memory-mapped: bf16
    assert mapped.quantization == "fp8"
    for n, w in weights.items():
        got, view = ckpt.weights[n], mapped.weights[n]
        assert got.dtype == torch.float32 and view.dtype == torch.bfloat16
        if n in stored:
            want = expected(*stored[n], scheme.block)
            assert torch.equal(got, want), n
            assert torch.equal(view, want.bfloat16()), n
            # A checkpoint of the weights, not only of itself.
            assert (got - w.float()).abs().max() <= w.float().abs().max() / 8, n
        else:  # embed, norms, biases, the LM head: as the bf16 checkpoint had them
            assert torch.equal(got, w.float()), n
            assert torch.equal(view, w), n


def test_the_config_announces_fp8_before_any_weight(
    source: tuple[Path, Weights], tmp_path: Path
) -> None:
    """The loader's hook hears "fp8" from an FP8 checkpoint's config before any weight, and
    nothing from float weights."""
    write_fp8(source, tmp_path / "fp8", SCHEMES["hf-block"])
    heard: list[Announced] = []
    ckpt = load_checkpoint(
        tmp_path / "fp8", progress=False, before_weights=lambda _cfg, a: heard.append(a)
    )
    assert heard == [Announced("fp8")] and ckpt.quantization == "fp8"
    load_checkpoint(source[0], progress=False, before_weights=lambda _cfg, a: heard.append(a))
    assert heard[1] == Announced()


def test_a_scale_in_another_shard(source: tuple[Path, Weights], tmp_path: Path) -> None:
    stored = write_fp8(source, tmp_path / "fp8", SCHEMES["hf-block"], split=True)
    assert {
        e.name.split(".")[-1]
        for e in read_header(tmp_path / "fp8" / "model-00002-of-00002.safetensors")
    } == {"weight_scale_inv"}
    ckpt = load_checkpoint(tmp_path / "fp8", progress=False, dtype=torch.float32)
    for n, (q, s) in stored.items():
        assert torch.equal(ckpt.weights[n], expected(q, s, (16, 16))), n
    # The order is the bf16 loader's (files in turn, each by HF name): the weights' shard
    # is ordered as the single bf16 file, and the scales leave no trace.
    plain = load_checkpoint(source[0], progress=False)
    assert list(ckpt.weights) == list(plain.weights)


def test_bytes_read_count_the_scales(
    source: tuple[Path, Weights], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_fp8(source, tmp_path / "fp8", SCHEMES["autofp8-tensor"], split=True)
    bars: list[Any] = []

    class Recording(ByteProgress):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(safetensors_loader, "ByteProgress", Recording)
    load_checkpoint(tmp_path / "fp8", progress=False, dtype=torch.float32)
    files = sorted((tmp_path / "fp8").glob("*.safetensors"))
    data = sum(e.nbytes for f in files for e in read_header(f))
    assert len(bars) == 1 and bars[0].total == bars[0].done == data


def test_a_config_left_over_on_bf16_weights(source: tuple[Path, Weights], tmp_path: Path) -> None:
    """A checkpoint converted back to bf16 that kept its quantization_config loads as bf16."""
    _copy(source[0], tmp_path / "bf16", SCHEMES["hf-block"].config)
    ckpt = load_checkpoint(tmp_path / "bf16", progress=False)
    assert ckpt.quantization is None
    assert all(torch.equal(ckpt.weights[n], w) for n, w in source[1].items())
    assert load_checkpoint(source[0], progress=False).quantization is None


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'awq'"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False}, "'gptq'"),
        (ct_config("group", bits=4, kind="int", group_size=128), "num_bits=4 type=int"),
    ],
)
def test_unsupported_checkpoints_fail_before_any_weight(
    source: tuple[Path, Weights], tmp_path: Path, config: dict[str, Any], says: str
) -> None:
    _copy(source[0], tmp_path / "q", config)

    def before(*_: object) -> None:
        raise AssertionError("the memory plan ran for a checkpoint that cannot load")

    with pytest.raises(UnsupportedQuantizationError, match=says):
        load_checkpoint(tmp_path / "q", progress=False, before_weights=before)


def test_a_float8_weight_without_its_scale(source: tuple[Path, Weights], tmp_path: Path) -> None:
    gone = "model.layers.1.mlp.down_proj.weight_scale_inv"
    write_fp8(source, tmp_path / "fp8", SCHEMES["hf-block"], edit=lambda t: t.pop(gone))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.down_proj\.weight is"):
        load_checkpoint(tmp_path / "fp8", progress=False)


def test_a_scale_without_a_float8_weight(source: tuple[Path, Weights], tmp_path: Path) -> None:
    hf = "model.layers.0.self_attn.o_proj.weight"
    bf16 = source[1]["layers.0.wo"]
    write_fp8(source, tmp_path / "fp8", SCHEMES["ct-channel"], edit=lambda t: t.update({hf: bf16}))
    with pytest.raises(UnexpectedTensorError, match=r"o_proj\.weight_scale scales .*bfloat16"):
        load_checkpoint(tmp_path / "fp8", progress=False)


def test_float8_weights_without_a_quantization_config(
    source: tuple[Path, Weights], tmp_path: Path
) -> None:
    def drop_scales(tensors: dict[str, torch.Tensor]) -> None:
        for k in [k for k in tensors if k.endswith("weight_scale")]:
            del tensors[k]

    write_fp8(source, tmp_path / "fp8", SCHEMES["ct-channel"])
    write_fp8(source, tmp_path / "bare", SCHEMES["ct-channel"], edit=drop_scales)
    for d in (tmp_path / "fp8", tmp_path / "bare"):
        config = json.loads((d / "config.json").read_text())
        del config["quantization_config"]
        (d / "config.json").write_text(json.dumps(config))
    # Without a scheme, a scale is no tensor of ours (as before); float8 weights alone
    # would load as scale-less numbers, so they are refused by name.
    with pytest.raises(UnexpectedTensorError, match=r"weight_scale is not used"):
        load_checkpoint(tmp_path / "fp8", progress=False)
    with pytest.raises(
        WeightLoadError,
        match=r"model\.layers\.0\..*float8_e4m3fn but config\.json has no quantization_config",
    ):
        load_checkpoint(tmp_path / "bare", progress=False)


def test_a_misshaped_scale(source: tuple[Path, Weights], tmp_path: Path) -> None:
    name = "model.layers.2.self_attn.k_proj.weight_scale"
    write_fp8(
        source,
        tmp_path / "fp8",
        SCHEMES["ct-channel"],
        edit=lambda t: t.update({name: t[name][:-1]}),
    )
    with pytest.raises(TensorShapeError, match=r"k_proj\.weight_scale.*\(103, 1\).*\(104, 520\)"):
        load_checkpoint(tmp_path / "fp8", progress=False)


# -- the same bits on the monokernel ---------------------------------------------------------


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_fp8_packing_reproduces_a_per_channel_checkpoint(
    source: tuple[Path, Weights], tmp_path: Path, scale_dtype: torch.dtype
) -> None:
    """The engine runs an FP8 checkpoint as fp8 by re-quantising each dequantised row to its
    amax / 448: with scales of each row's amax / 448 (llm-compressor's min-max default,
    fbgemm's) the row's largest value is +-448 * scale, so packing gives back the stored E4M3
    bytes exactly, from float32 weights and from their bf16 rounding alike. The scales come
    back exactly where they are bf16 (as llm-compressor stores them), within one float32
    ulp where they are float32 (448 * s / 448 rounds), within bf16's rounding (2^-8) after a
    bf16 round trip."""
    scheme = Scheme(ct_config("channel"), "weight_scale", lambda w: q_channel(w, scale_dtype))
    stored = write_fp8(source, tmp_path / "fp8", scheme)
    assert (
        load_file(tmp_path / "fp8" / SINGLE_FILE)["model.layers.0.mlp.up_proj.weight_scale"].dtype
        == scale_dtype
    )
    ckpt = load_checkpoint(tmp_path / "fp8", progress=False, dtype=torch.float32)
    fp8 = get_format("fp8")
    for n, (q, s) in stored.items():
        s32 = s.float().reshape(-1)
        for w, rtol in ((ckpt.weights[n], 0.0), (ckpt.weights[n].bfloat16(), 2.0**-8)):
            packed = fp8.pack(w)
            assert torch.equal(packed.data.view(torch.uint8), q.view(torch.uint8)), n
            got = packed.scales[0]
            if w.dtype == torch.float32 and scale_dtype == torch.bfloat16:
                assert torch.equal(got, s32), n
            elif w.dtype == torch.float32:
                assert torch.allclose(got, s32, rtol=2.0**-23, atol=0), n
            else:
                assert torch.allclose(got, s32, rtol=rtol, atol=0), n


def test_the_engine_runs_an_fp8_checkpoint_as_fp8(
    source: tuple[Path, Weights], tmp_path: Path
) -> None:
    from monokernel.runtime.engine import Engine, EngineConfig
    from monokernel.runtime.sampling import SamplingParams

    write_fp8(source, tmp_path / "fp8", SCHEMES["ct-channel-bf16-scales"])
    config = EngineConfig(engine="reference", device="cpu", progress=False, max_model_len=64)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine = Engine(tmp_path / "fp8", config)
    try:
        assert engine.quantize == "fp8"
        fp8_tokens = engine.complete("def fib(n):", params).token_ids
        assert len(fp8_tokens) == 6
    finally:
        engine.close()
    # The dequantised weights as a plain checkpoint: fp8 packing reproduces them exactly
    # (bf16 scales), so the fp8 engine computed the checkpoint's own model.
    ckpt = load_checkpoint(tmp_path / "fp8", progress=False, dtype=torch.float32)
    plain = Engine(dataclasses.replace(ckpt, quantization=None), config)
    try:
        assert plain.quantize is None
        assert plain.complete("def fib(n):", params).token_ids == fp8_tokens
    finally:
        plain.close()
    # --quantize still decides when given.
    int8 = Engine(tmp_path / "fp8", dataclasses.replace(config, quantize="int8"))
    try:
        assert int8.quantize == "int8"
    finally:
        int8.close()


@pytest.mark.parametrize("scheme", ["hf-block", "ct-block"])
def test_block_scales_are_kept_beside_the_weights(
    source: tuple[Path, Weights], tmp_path: Path, scheme: str
) -> None:
    """A block-scaled checkpoint's scales of every layer linear weight come back in
    Checkpoint.fp8_blocks, the factor each weight's block multiplies by, so the monokernel
    can stream the checkpoint's own E4M3 values (weights/formats/fp8.py block scales)."""
    stored = write_fp8(source, tmp_path / "fp8", SCHEMES[scheme])
    ckpt = load_checkpoint(tmp_path / "fp8", progress=False, dtype=torch.float32)
    blocks = ckpt.fp8_blocks
    assert ckpt.quantization == "fp8" and blocks is not None
    assert (blocks.rows, blocks.cols) == SCHEMES[scheme].block
    assert set(blocks.scales) == set(stored)
    for name, (q, s) in stored.items():
        assert torch.equal(blocks.scales[name], s.float()), name
        out = q.shape[0]
        assert torch.equal(
            blocks.row_scales(name, out), s.float().repeat_interleave(blocks.rows, 0)[:out]
        )


def test_a_per_channel_checkpoint_has_no_blocks(
    source: tuple[Path, Weights], tmp_path: Path
) -> None:
    write_fp8(source, tmp_path / "fp8", SCHEMES["ct-channel"])
    assert load_checkpoint(tmp_path / "fp8", progress=False).fp8_blocks is None


def test_the_engines_compute_a_block_checkpoint_as_stored(
    source: tuple[Path, Weights], tmp_path: Path
) -> None:
    """With block scales the other engines compute with the checkpoint's own dequantised
    values (not re-quantised a row): the same tokens as the same values loaded as a plain
    checkpoint."""
    from monokernel.runtime.engine import Engine, EngineConfig
    from monokernel.runtime.sampling import SamplingParams

    write_fp8(source, tmp_path / "fp8", SCHEMES["hf-block"])
    config = EngineConfig(engine="reference", device="cpu", progress=False, max_model_len=64)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ckpt = load_checkpoint(tmp_path / "fp8", progress=False, dtype=torch.float32)
    tokens = []
    for c in (ckpt, dataclasses.replace(ckpt, quantization=None, fp8_blocks=None)):
        engine = Engine(c, config)
        try:
            assert engine.quantize == c.quantization
            tokens.append(engine.complete("def fib(n):", params).token_ids)
            w = engine.backend.model.w["layers.0.w_up"]  # type: ignore[attr-defined]
            assert torch.equal(w, ckpt.weights["layers.0.w_up"])
        finally:
            engine.close()
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6
