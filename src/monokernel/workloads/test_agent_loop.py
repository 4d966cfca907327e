"""The agent-loop workload on the reference engine (in-process and over HTTP) and on fakes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from monokernel.runtime.engine import Engine, EngineConfig
from monokernel.testing.tiny_models import make_tiny_model_dir
from monokernel.workloads.agent_loop import (
    AgentLoopConfig,
    ChatResult,
    EngineClient,
    Message,
    WorkloadError,
    run_agent_loop,
)
from monokernel.workloads.cli import main
from monokernel.workloads.script import REPEAT_FROM, STEPS, step_for_turn

QUICK = AgentLoopConfig(turns=2, gen_tokens=3, warmup=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = make_tiny_model_dir("qwen2", tmp_path_factory.mktemp("agent") / "tiny")
    # The tiny tokenizer spends ~1 token per 2 characters, so the session outgrows the
    # tiny config's 256 positions; RoPE has no trained limit for random weights anyway.
    cfg = json.loads((d / "config.json").read_text()) | {"max_position_embeddings": 8192}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    eng = Engine(model_dir, EngineConfig(engine="reference", device="cpu", progress=False))
    yield eng
    eng.close()


def test_reference_engine_session(engine: Engine) -> None:
    report = run_agent_loop(EngineClient(engine), QUICK)
    first, second = report.turns
    assert (first.phase, second.phase) == ("plan", "patch")
    assert first.generated_tokens == second.generated_tokens == 3  # ignore_eos: exact counts
    # Turn 2 re-sends turn 1's prompt, its answer and the next tool output.
    assert second.prompt_tokens > first.prompt_tokens + 3 + 100
    assert all(t.ttft_s > 0 and t.decode_s > 0 and t.decode_tok_s > 0 for t in report.turns)
    parts = report.prefill_s + report.decode_s + report.tool_s
    assert parts <= report.wall_s
    out = report.to_json()
    assert out["totals"]["generated_tokens"] == 6
    assert out["totals"]["final_prompt_tokens"] == second.prompt_tokens
    assert [t["phase"] for t in out["turns"]] == ["plan", "patch"]
    assert "prefill" in report.table() and "reference engine on cpu" in report.table()


class FakeClient:
    """Answers instantly in fake time: 0.5 s to the first token, 2 s of decode."""

    name = "fake"

    def __init__(self, now: list[float]) -> None:
        self.now = now
        self.seen: list[list[Message]] = []

    def chat(self, messages: list[Message], max_tokens: int, cfg: AgentLoopConfig) -> ChatResult:
        self.seen.append([dict(m) for m in messages])
        self.now[0] += 2.5
        return ChatResult("diff --git a/x b/x", 100 * len(self.seen), max_tokens, 0.5, 2.0)


def test_time_split_and_conversation_growth() -> None:
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    client = FakeClient(now)
    config = AgentLoopConfig(turns=3, gen_tokens=201, tool_sleep_s=1.0, warmup=False)
    report = run_agent_loop(client, config, clock=lambda: now[0], sleep=sleep)
    assert report.wall_s == pytest.approx(3 * 3.5)
    assert (report.prefill_s, report.decode_s, report.tool_s) == (1.5, 6.0, 3.0)
    assert report.other_s == pytest.approx(0.0)
    assert report.turns[0].decode_tok_s == pytest.approx(200 / 2.0)
    # system + (task with the first tool output), then assistant/user pairs per turn.
    roles = [[m["role"] for m in msgs] for msgs in client.seen]
    assert roles[0] == ["system", "user"]
    assert roles[2] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert STEPS[0].output in client.seen[0][1]["content"]
    assert STEPS[2].output in client.seen[2][-1]["content"]


def test_script_repeats_the_fix_cycle() -> None:
    n = len(STEPS)
    assert step_for_turn(n) == STEPS[REPEAT_FROM]
    assert step_for_turn(n + (n - REPEAT_FROM)) == STEPS[REPEAT_FROM]


def test_context_overflow_names_the_turn(model_dir: Path) -> None:
    eng = Engine(
        model_dir,
        EngineConfig(engine="reference", device="cpu", max_model_len=1500, progress=False),
    )
    try:
        with pytest.raises(WorkloadError, match=r"turn 2 \(patch\).*context"):
            run_agent_loop(EngineClient(eng), QUICK)
    finally:
        eng.close()


def test_cli_writes_json(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "agent.json"
    argv = ["--model", str(model_dir), "--engine", "reference", "--device", "cpu"]
    argv += ["--turns", "1", "--gen-tokens", "2", "--json", str(out)]
    assert main(argv) == 0
    assert "TTFT ms" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["config"]["turns"] == 1 and data["turns"][0]["generated_tokens"] == 2


def test_cli_takes_runs_speculative_flags_in_process_only(
    model_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = ["--model", str(model_dir), "--engine", "reference", "--device", "cpu"]
    argv += ["--turns", "1", "--gen-tokens", "3", "--json", "-"]
    assert main([*argv, "--speculative", "ngram", "--ngram-min", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["turns"][0]["generated_tokens"] == 3
    with pytest.raises(SystemExit) as refused:
        main(["--endpoint", "http://127.0.0.1:9", "--speculative", "off"])
    assert refused.value.code == 2
    assert "--speculative: in-process only" in capsys.readouterr().err


def test_against_live_server(engine: Engine) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import httpx

    from monokernel.serve.app import create_app
    from monokernel.serve.settings import ServerSettings
    from monokernel.serve.testing import live_server
    from monokernel.workloads.agent_loop import EndpointClient

    with live_server(create_app(ServerSettings("tiny-agent"), lambda: engine)) as url:
        deadline = time.monotonic() + 20
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.02)
        client = EndpointClient(url + "/v1")
        try:
            assert client.model == "tiny-agent"  # the first (only) listed model
            remote = run_agent_loop(client, QUICK)
        finally:
            client.close()
    local = run_agent_loop(EngineClient(engine), QUICK)
    # Same template and tokenizer behind the server: the same prompts, exact token counts.
    assert [t.prompt_tokens for t in remote.turns] == [t.prompt_tokens for t in local.turns]
    assert [t.generated_tokens for t in remote.turns] == [3, 3]
    # The tiny model emits byte fragments the server holds back, so a turn may show only
    # one visible token (decode time 0); a real model's turns show them all.
    assert all(t.ttft_s > 0 and t.decode_s >= 0 for t in remote.turns), remote.turns
