"""A scripted coding-agent session timed turn by turn: where does an agent's wall time go?

Each turn the simulated tool runs (a configurable sleep), its canned output is appended to
the conversation, and the model generates its next answer. The report splits wall time into
prefill (time to first token), decode and tool time, with tokens/s per turn. Nothing is
cached between turns: every turn re-sends the whole conversation, as an agent client does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from monokernel.errors import MonokernelError
from monokernel.workloads.script import SYSTEM_PROMPT, TASK, step_for_turn, tool_message

if TYPE_CHECKING:
    from monokernel.runtime.engine import Engine

Message = dict[str, str]


class WorkloadError(MonokernelError):
    """The workload could not run (endpoint error, context overflow)."""


@dataclass(frozen=True, slots=True)
class AgentLoopConfig:
    turns: int = 6
    gen_tokens: int = 256
    tool_sleep_s: float = 0.0  # simulated tool latency per turn
    temperature: float = 0.0
    seed: int = 0
    # Generate exactly gen_tokens every turn so runs and engines compare like for like.
    ignore_eos: bool = True
    warmup: bool = True  # one short untimed request first (compiles, caches, connections)

    def __post_init__(self) -> None:
        if self.turns < 1 or self.gen_tokens < 1 or self.tool_sleep_s < 0:
            raise ValueError("turns and gen_tokens must be >= 1 and tool_sleep_s >= 0")


@dataclass(frozen=True, slots=True)
class ChatResult:
    text: str
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float  # request sent -> first token
    decode_s: float  # first token -> last token


class ChatClient(Protocol):
    name: str

    def chat(
        self, messages: list[Message], max_tokens: int, cfg: AgentLoopConfig
    ) -> ChatResult: ...


@dataclass(frozen=True, slots=True)
class TurnRecord:
    turn: int
    phase: str
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float
    decode_s: float
    tool_s: float
    wall_s: float  # tool step + request, end to end

    @property
    def decode_tok_s(self) -> float:
        steps = self.generated_tokens - 1  # the first token is prefill's
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class AgentLoopReport:
    target: str
    config: AgentLoopConfig
    turns: tuple[TurnRecord, ...]
    wall_s: float

    @property
    def prefill_s(self) -> float:
        return sum(t.ttft_s for t in self.turns)

    @property
    def decode_s(self) -> float:
        return sum(t.decode_s for t in self.turns)

    @property
    def tool_s(self) -> float:
        return sum(t.tool_s for t in self.turns)

    @property
    def other_s(self) -> float:
        """Tokenisation, HTTP, bookkeeping: wall time in no other bucket."""
        return max(self.wall_s - self.prefill_s - self.decode_s - self.tool_s, 0.0)

    @property
    def generated_tokens(self) -> int:
        return sum(t.generated_tokens for t in self.turns)

    @property
    def decode_tok_s(self) -> float:
        steps = sum(max(t.generated_tokens - 1, 0) for t in self.turns)
        return steps / self.decode_s if self.decode_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "config": asdict(self.config),
            "turns": [
                asdict(t) | {"decode_tok_s": t.decode_tok_s, "prefill_tok_s": t.prefill_tok_s}
                for t in self.turns
            ],
            "totals": {
                "wall_s": self.wall_s,
                "prefill_s": self.prefill_s,
                "decode_s": self.decode_s,
                "tool_s": self.tool_s,
                "other_s": self.other_s,
                "generated_tokens": self.generated_tokens,
                "decode_tok_s": self.decode_tok_s,
                "final_prompt_tokens": self.turns[-1].prompt_tokens,
            },
        }

    def table(self) -> str:
        head = ["turn", "phase", "prompt tok", "gen tok", "TTFT ms", "decode ms", "decode tok/s"]
        head += ["tool ms", "wall ms"]
        rows = [head]
        for t in self.turns:
            rows.append(
                [
                    str(t.turn),
                    t.phase,
                    str(t.prompt_tokens),
                    str(t.generated_tokens),
                    f"{t.ttft_s * 1e3:.1f}",
                    f"{t.decode_s * 1e3:.1f}",
                    f"{t.decode_tok_s:.1f}",
                    f"{t.tool_s * 1e3:.1f}",
                    f"{t.wall_s * 1e3:.1f}",
                ]
            )
        rows.append(
            [
                "all",
                "",
                "",
                str(self.generated_tokens),
                f"{self.prefill_s * 1e3:.1f}",
                f"{self.decode_s * 1e3:.1f}",
                f"{self.decode_tok_s:.1f}",
                f"{self.tool_s * 1e3:.1f}",
                f"{self.wall_s * 1e3:.1f}",
            ]
        )
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = [
            "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |"
            for r in rows
        ]
        lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")

        def share(x: float) -> str:
            return f"{x:.3f} s ({x / self.wall_s:.0%})" if self.wall_s > 0 else f"{x:.3f} s"

        lines.append(
            f"{self.target}: wall {self.wall_s:.3f} s = prefill {share(self.prefill_s)} + "
            f"decode {share(self.decode_s)} + tool {share(self.tool_s)} + "
            f"other {share(self.other_s)}"
        )
        return "\n".join(lines)


def run_agent_loop(
    client: ChatClient,
    config: AgentLoopConfig,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> AgentLoopReport:
    if config.warmup:
        client.chat([{"role": "user", "content": "Say OK."}], min(8, config.gen_tokens), config)
    messages: list[Message] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": TASK},
    ]
    records: list[TurnRecord] = []
    start = clock()
    for turn in range(config.turns):
        step = step_for_turn(turn)
        turn_start = clock()
        sleep(config.tool_sleep_s)  # the tool "runs"
        tool_s = clock() - turn_start
        # Tool output goes in as a user turn: every chat template accepts that, while the
        # `tool` role needs tool-call ids that many templates (and our tiny ones) lack.
        content = tool_message(step)
        if messages[-1]["role"] == "user":  # the first turn: task and tool output together
            messages[-1] = {"role": "user", "content": messages[-1]["content"] + "\n\n" + content}
        else:
            messages.append({"role": "user", "content": content})
        try:
            result = client.chat(messages, config.gen_tokens, config)
        except MonokernelError as e:
            raise WorkloadError(f"turn {turn + 1} ({step.phase}): {e}") from e
        messages.append({"role": "assistant", "content": result.text})
        records.append(
            TurnRecord(
                turn=turn + 1,
                phase=step.phase,
                prompt_tokens=result.prompt_tokens,
                generated_tokens=result.generated_tokens,
                ttft_s=result.ttft_s,
                decode_s=result.decode_s,
                tool_s=tool_s,
                wall_s=clock() - turn_start,
            )
        )
    return AgentLoopReport(client.name, config, tuple(records), clock() - start)


# --------------------------------------------------------------------------- clients


class EngineClient:
    """An in-process Engine; timings are the engine's own (request start -> tokens)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.name = f"{engine.engine_name} engine on {engine.device}"

    def chat(self, messages: list[Message], max_tokens: int, cfg: AgentLoopConfig) -> ChatResult:
        from monokernel.runtime.sampling import SamplingParams

        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=cfg.temperature,
            seed=cfg.seed,
            ignore_eos=cfg.ignore_eos,
        )
        ids = self.engine.encode(messages)
        parts: list[str] = []
        final = None
        for event in self.engine.generate(messages, params, prompt_ids=ids):
            parts.append(event.text)
            if event.token_id is None:
                final = event
        assert final is not None and final.timings is not None
        t = final.timings
        return ChatResult("".join(parts), t.prompt_tokens, t.generated_tokens, t.ttft_s, t.decode_s)


class EndpointClient:
    """An OpenAI-compatible server, streamed; times are measured here, as a client sees them."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        import httpx  # only the endpoint mode needs it

        base = base_url.rstrip("/")
        self.base_url = base[: -len("/v1")] if base.endswith("/v1") else base
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(timeout=timeout_s, headers=headers)
        self.model = model or self._first_model()
        self.name = f"{self.model} at {self.base_url}"

    def _first_model(self) -> str:
        import httpx

        try:
            r = self.http.get(self.base_url + "/v1/models")
        except httpx.HTTPError as e:
            raise WorkloadError(f"could not reach {self.base_url}: {e}") from e
        if r.status_code != 200:
            raise WorkloadError(f"GET /v1/models answered {r.status_code}: {r.text[:300]}")
        models = r.json().get("data") or []
        if not models:
            raise WorkloadError("the endpoint lists no models; pass --served-model")
        return str(models[0]["id"])

    def chat(self, messages: list[Message], max_tokens: int, cfg: AgentLoopConfig) -> ChatResult:
        import httpx

        try:
            return self._chat(messages, max_tokens, cfg)
        except httpx.HTTPError as e:
            raise WorkloadError(f"request to {self.base_url} failed: {e}") from e

    def _chat(self, messages: list[Message], max_tokens: int, cfg: AgentLoopConfig) -> ChatResult:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": cfg.temperature,
            "seed": cfg.seed,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if cfg.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extra; monokernel serve takes it too
        parts: list[str] = []
        usage: dict[str, Any] | None = None
        chunks = 0
        start = time.perf_counter()
        first = last = None
        with self.http.stream("POST", self.base_url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise WorkloadError(f"the endpoint answered {r.status_code}: {r.text[:500]}")
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    # Servers open with a role-only chunk before any token and may end
                    # with a text-less finishing chunk: neither is a token arrival. A token
                    # whose text is held back (half a UTF-8 character) may send nothing, so
                    # decode time runs from the first to the last visible token.
                    text = delta.get("content") or ""
                    parts.append(text)
                    if "role" in delta or not (text or choice.get("finish_reason") is None):
                        continue
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    chunks += 1
        end = time.perf_counter()
        first = end if first is None else first
        last = first if last is None else last
        generated = int(usage["completion_tokens"]) if usage else chunks
        prompt = int(usage["prompt_tokens"]) if usage else 0
        return ChatResult("".join(parts), prompt, generated, first - start, last - first)

    def close(self) -> None:
        self.http.close()
