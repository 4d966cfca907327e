"""The model catalogue: one entry per name, the kernel's shapes apart from those it cannot
build yet, and issue 34's shapes present for the roofline and the torch engine."""

from __future__ import annotations

from monokernel.models.architecture import Precision, shape_of
from monokernel.models.shapes import CATALOGUE, DENSE_SHAPES, SHAPES, find_model

ISSUE_34 = (
    "llama-3.1-8b",
    "qwen2.5-coder-7b",
    "qwen2.5-coder-14b",
    "qwen2.5-coder-32b",
    "qwen3-4b",
    "qwen3-8b",
    "qwen3-14b",
    "mistral-7b",
)


def test_keys_and_aliases_name_one_entry_each() -> None:
    assert all(key == entry.name.lower() for key, entry in CATALOGUE.items())
    aliases = [a for e in CATALOGUE.values() for a in e.aliases]
    assert len(aliases) == len(set(aliases))
    assert not set(aliases) & set(CATALOGUE)
    assert all(find_model(a) is e for e in CATALOGUE.values() for a in e.aliases)
    assert find_model("QWEN3-0.6B") is CATALOGUE["qwen3-0.6b"]
    assert find_model("no-such-model") is None


def test_dense_entries_carry_their_config_and_its_shape() -> None:
    for key, entry in CATALOGUE.items():
        if entry.config is None:
            assert entry.shape.is_moe or entry.shape.is_mla or entry.shape.sliding_window, key
            assert not entry.kernel
        else:
            assert entry.shape == shape_of(entry.config, entry.name)
    assert set(SHAPES) <= set(DENSE_SHAPES)


def test_the_kernel_builds_every_dense_shape() -> None:
    """The benchmarks, prebuild and GPU tests iterate SHAPES: every dense shape, up to the
    32B one, gets the kernel's dimensions and a K/V window in shared memory (the compile
    itself: kernels/test_build.py)."""
    from monokernel.kernels.build import KernelDims

    assert set(SHAPES) == set(DENSE_SHAPES)
    for key, cfg in SHAPES.items():
        assert KernelDims.from_config(cfg).attn_chunk() >= 32, key
    assert max(cfg.hidden_size for cfg in SHAPES.values()) > 4096


def test_issue_34_shapes_are_dense_bf16_with_their_source() -> None:
    for key in ISSUE_34:
        entry = CATALOGUE[key]
        assert entry.config is not None and key in SHAPES
        assert entry.native == Precision("bf16")
        assert "/" in entry.source, key  # owner/repo on the HF hub
    # Every real model names the repository its numbers come from; only the odd ones are
    # made up.
    assert [k for k, e in CATALOGUE.items() if not e.source] == ["odd", "odd-wide"]
