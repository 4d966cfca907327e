"""``monokernel bench --workload``: speculative decoding on the agent-shaped workloads, on the
CPU (a tiny random model with the reference engine, and stand-in backends). No timing
assertions."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from monokernel.bench import spec
from monokernel.bench.cli import main
from monokernel.runtime.backends.base import CancelToken, DecodeRequest
from monokernel.runtime.speculative import SpeculationStats, SpeculativeConfig
from monokernel.testing.tiny_models import make_tiny_model_dir
from monokernel.workloads.spec_workloads import SpecWorkload


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with a tokenizer and chat template."""
    return make_tiny_model_dir("llama3", tmp_path_factory.mktemp("spec") / "tiny")


def test_reference_engine_records_every_mode(
    chat_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "spec.json"
    argv = ["--model", str(chat_model), "--device", "cpu", "--engines", "reference"]
    argv += ["--workload", "spec-chat", "--gen-tokens", "12"]
    assert main([*argv, "--num-speculative-tokens", "2,4", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["kind"] == spec.KIND and doc["schema_version"] == spec.SCHEMA_VERSION
    records = doc["records"]
    assert [(r["workload"], r["k"]) for r in records] == [
        ("spec-chat", 0), ("spec-chat", 2), ("spec-chat", 4),
    ]  # fmt: skip
    for r in records:
        assert r["status"] == "ok" and r["engine"] == "reference"
        # The reference engine verifies drafts exactly: greedy output is the same with them.
        assert r["identical"] is True and r["mismatch"] is None
        assert r["requests"] == 3 and len(r["prompt_tokens"]) == 3
        assert r["max_tokens"] == 12 and r["generated_tokens"] <= 12 * r["requests"]
        assert r["decode_tok_s"]["median"] > 0 and len(r["runs_raw"]) == r["repeats"] == 1
        # tokens after the first = passes + accepted drafts; each pass emits >= 1 token
        assert r["forward_passes"] + r["accepted"] == r["generated_tokens"] - r["requests"]
        assert r["accepted"] <= r["drafted"]
        assert r["copied_lines"] is None  # chat has nothing to copy
        if r["k"] == 0:
            assert r["drafted"] == r["verify_passes"] == 0 and r["tokens_per_pass"] == 1.0
            assert r["vs_off"] == 1.0 and len(r["outputs"]) == r["requests"]
        else:
            assert r["speculative"]["num_tokens"] == r["k"] and r["vs_off"] > 0
            assert r["tokens_per_pass"] >= 1.0
    assert sum(r["drafted"] for r in records) > 0  # the drafts were tried, not just counted
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("device: cpu") and lines[1].split()[:3] == [
        "engine",
        "workload",
        "K",
    ]
    assert sum(line.startswith("reference") for line in lines) == 3
    assert not any("MISMATCH" in line for line in lines)


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--engines", "monokernel", "--num-speculative-tokens", "8"], "at most 7 drafted"),
        (["--engines", "torch,hf"], "verify drafts (torch, reference, monokernel); not 'hf'"),
        (["--num-speculative-tokens", "4,40"], "must be an integer in [1, 32]; got 40"),
        (["--prompt-tokens", "64"], "--workload does not take --prompt-tokens"),
        (["--shape", "llama-3.2-1b"], "--workload does not take --shape"),
        (["--hf-cache", "dynamic", "--seed", "1"], "does not take --hf-cache, --seed"),
        (["--gen-tokens", "64,128"], "one --gen-tokens value"),
        (["--ngram-max", "3", "--ngram-min", "4"], "--ngram-min <= --ngram-max"),
    ],
)
def test_refusals_before_loading(
    argv: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--device", "cpu", "--workload", "spec-chat", *argv]) == 2
    assert why in capsys.readouterr().err


def test_speculative_flags_need_a_workload(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--num-speculative-tokens", "--ngram-max", "--ngram-min"):
        assert main(["--device", "cpu", flag, "4"]) == 2
        assert f"{flag} needs --workload" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--workload", "spec-nope"])


# -- stand-ins: the mismatch check and the counts, without a model ------------------------


class _Codec:
    def encode_prompt(self, prompt: list[dict[str, str]]) -> list[int]:
        return [len(m["content"]) % 97 for m in prompt] + [1, 2, 3]

    def decode(self, ids: Sequence[int]) -> str:
        return "\n".join(f"line {i}" for i in ids)


class _Backend:
    """Emits 0..n-1; with drafts it reports ``accepted`` of ``drafted`` over ``passes`` and,
    when ``flip_at`` is set, emits a different token there (a broken verifier)."""

    def __init__(self, flip_at: int | None = None, drift: bool = False, max_len: int = 0) -> None:
        self.flip_at, self.drift, self.max_len = flip_at, drift, max_len
        self.speculative: SpeculativeConfig | None = None
        self.speculation: SpeculationStats | None = None
        self.requests = 0

    def set_speculative(self, config: SpeculativeConfig | None) -> None:
        self.speculative = config

    def stream(self, request: DecodeRequest, cancel: CancelToken) -> Iterator[int]:
        self.requests += 1
        n = request.max_new_tokens
        if self.max_len:  # the real backends' bound: positions past the cache fail
            assert len(request.prompt_ids) + n <= self.max_len
        if self.speculative is not None:
            self.speculation = SpeculationStats(passes=3, drafted=8, accepted=6)
        for i in range(n):
            token = i
            if self.speculative is not None and i == self.flip_at:
                token = 1000
            if self.drift and self.speculative is None and self.requests > 2 and i == n - 1:
                token = 2000  # the same request without drafts, not reproducible
            yield token

    def close(self) -> None:
        pass


def _workload(copy_text: str | None = "line 3\nline 4\nsomething else\n") -> SpecWorkload:
    return SpecWorkload(
        "fake", "a stand-in", (({"role": "user", "content": "hi"},),), 10, copy_text
    )


def _records(backend: _Backend, repeats: int = 1) -> list[dict]:
    config = spec.SpecBenchConfig(("fake",), (_workload(),), ks=(4,), repeats=repeats)
    prompts = [[5, 1, 2, 3]]
    records = spec.measure_workload(
        backend, "fake", _workload(), prompts, config, _Codec(), log=lambda _: None
    )
    spec.add_ratios(records)
    return records


def _doc(records: list[dict]) -> dict:
    doc = spec.new_document({"device": "cpu"}, {"label": "fake", "weights": "float32"}, {})
    doc["records"] = records
    return doc


def test_counts_and_acceptance_length() -> None:
    off, on = _records(_Backend())
    assert off["k"] == 0 and on["k"] == 4
    assert on["identical"] and off["identical"]
    assert on["generated_tokens"] == 10 and on["drafted"] == 8 and on["accepted"] == 6
    assert on["verify_passes"] == 3 and on["accepted_per_pass"] == 2.0
    assert on["forward_passes"] == 10 - 1 - 6 and on["tokens_per_pass"] == 9 / 3
    assert off["forward_passes"] == 9 and off["tokens_per_pass"] == 1.0
    assert on["copied_lines"] == [2, 3]  # "line 3" and "line 4" of the three
    assert on["self_repeat"] == 0.0  # 0..9: no 8-gram twice
    assert off["outputs"] == [_Codec().decode(range(10))] and "outputs" not in on
    table = spec.format_table(_doc([off, on]))
    assert "MISMATCH" not in table and table.splitlines()[-1].split()[-1] == "yes"


def test_a_draft_changing_the_output_is_reported_loudly() -> None:
    off, on = _records(_Backend(flip_at=5))
    assert off["identical"] and not on["identical"]
    assert on["mismatch"] == {
        "repeat": 0, "request": 0, "index": 5, "expected": 5, "got": 1000,
        "expected_tokens": 10, "got_tokens": 10,
    }  # fmt: skip
    doc = _doc([off, on])
    (line,) = spec.mismatch_lines(doc)
    assert line.startswith("MISMATCH: fake fake K=4: request 1 (repeat 1)")
    assert "at token 5 (expected 5, got 1000" in line
    table = spec.format_table(doc).splitlines()
    assert table[-1] == line and table[-2].split()[-1] == "NO"


def test_repeats_without_drafts_must_agree_too() -> None:
    # requests 1-2 are the first repeat (off, K=4); the second repeat's off run drifts
    off, on = _records(_Backend(drift=True), repeats=2)
    assert not off["identical"] and off["mismatch"]["repeat"] == 1
    assert off["mismatch"]["index"] == 9
    assert on["identical"]
    assert "without drafts (repeat)" in spec.mismatch_lines(_doc([off, on]))[0]


def test_self_repeat_tells_a_loop_from_a_copy() -> None:
    assert spec.self_repeat([list(range(20))]) == 0.0
    assert spec.self_repeat([[1, 2] * 10]) == (13 - 2) / 13  # past 2 grams, all repeats
    assert spec.self_repeat([[1, 2] * 10], n=2) == 17 / 19
    assert spec.self_repeat([[1, 2, 3]]) is None  # shorter than one 8-gram
    # grams do not carry across outputs (requests)
    assert spec.self_repeat([list(range(8)), list(range(8))]) == 0.0


def test_first_mismatch() -> None:
    assert spec.first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert spec.first_mismatch([1, 2, 3], [1, 9, 3]) == 1
    assert spec.first_mismatch([1, 2, 3], [1, 2]) == 2  # shorter counts
    assert spec.first_mismatch([1, 2], [1, 2, 3]) == 2


def test_a_failing_engine_is_a_record_and_the_others_still_run() -> None:
    def open_backend(engine: str, max_len: int) -> _Backend:
        if engine == "broken":
            raise RuntimeError("no such engine")
        assert max_len == 4 + 10 + 1  # the prompt, the cap and the token after
        return _Backend(max_len=max_len)  # the warm-up too stays within the cap (10 < 32)

    config = spec.SpecBenchConfig(("broken", "fake"), (_workload(),), ks=(2,))
    doc = _doc([])
    spec.run_spec_bench(open_backend, _Codec(), config, doc, log=lambda _: None)
    first, *rest = doc["records"]
    assert first["status"] == "error" and "no such engine" in first["error"]
    assert [(r["engine"], r["k"], r["status"]) for r in rest] == [
        ("fake", 0, "ok"),
        ("fake", 2, "ok"),
    ]
    assert "error: RuntimeError: no such engine" in spec.format_table(doc)
