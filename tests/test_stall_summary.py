"""tools/stall_summary.py against a small hand-written ncu source page."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "stall_summary.py"
spec = importlib.util.spec_from_file_location("stall_summary", SCRIPT)
assert spec and spec.loader
stall_summary = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = stall_summary  # dataclasses look their module up there
spec.loader.exec_module(stall_summary)

HEADER = (
    '"Address","Source","Instructions Executed","L1 Wavefronts Shared Excessive",'
    '"stall_long_sb","stall_no_inst","stall_long_sb (Not Issued)"'
)
PAGE = "\n".join(
    [
        '"Kernel Name","mk_decode",',
        HEADER,
        '"0x7f0000001000","  LDG.E.128 R4, [R2.64]","2,112","0","90","1","70"',
        '"0x7f0000001010","  LDS.128 R8, [R3]","2112","640","5","9","4"',
        '"0x7f0000001200","  EXIT","0","-","0","0","0"',
    ]
)


def test_reads_offsets_counts_and_stalls() -> None:
    ins = stall_summary.read_source_page(PAGE)
    assert [i.offset for i in ins] == [0, 16, 512]
    assert [i.executed for i in ins] == [2112, 2112, 0]
    # Only the sampled states, not their "(Not Issued)" subsets.
    assert ins[0].stalls == {"long_sb": 90, "no_inst": 1}
    assert [i.smem_excess for i in ins] == [0, 640, 0]


def test_summary_counts_only_executed_code() -> None:
    text = stall_summary.summarize(stall_summary.read_source_page(PAGE))
    assert "3 instructions" in text and "105 warp samples" in text
    # Two instructions ran, both in the first 128-byte line.
    assert "code executed: 0.0 KB in 1 128-byte lines" in text
    assert "long_sb 90%" in text.splitlines()[1]


def test_rejects_a_page_without_instructions() -> None:
    with pytest.raises(ValueError, match="no instruction rows"):
        stall_summary.read_source_page('"Kernel Name","mk_decode",\n' + HEADER + "\n")
