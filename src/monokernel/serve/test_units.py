"""The queue and the metrics on their own, without a server."""

from __future__ import annotations

import asyncio

import pytest

from monokernel.serve.body import validation_message
from monokernel.serve.metrics import Metrics
from monokernel.serve.scheduler import Abandoned, QueueFullError, Scheduler, Ticket


def test_scheduler_is_fifo_bounded_and_drops_leavers() -> None:
    async def scenario() -> list[str]:
        sched = Scheduler(max_queue=2)
        first = sched.enter()
        assert first.granted and sched.running == 1
        second, third = sched.enter(), sched.enter()
        with pytest.raises(QueueFullError, match="1 request running and 2 waiting"):
            sched.enter()
        order: list[str] = []

        async def run(name: str, ticket: Ticket) -> None:
            try:
                await ticket.wait()
            except Abandoned:
                order.append(name + " left")
                return
            order.append(name)
            ticket.release()

        tasks = [
            asyncio.create_task(run("second", second)),
            asyncio.create_task(run("third", third)),
        ]
        await asyncio.sleep(0)
        second.release()  # its client went away while queued
        assert sched.waiting == 1
        first.release()
        await asyncio.gather(*tasks)
        assert sched.running == 0 and sched.waiting == 0
        first.release()  # idempotent
        return order

    assert asyncio.run(scenario()) == ["second left", "third"]


def test_metrics_exposition() -> None:
    m = Metrics("org/tiny")
    m.observe_ttft(0.003)
    m.observe_itl(0.0007)
    m.observe_itl(3.0)
    m.finish("length", 10, 5, 0.5)
    m.finish(
        "stop", 4, 9, 0.2, drafted_n=12, accepted_n=7,
        queue_s=0.05, prefill_s=0.01, decode_s=0.1, cached_n=3,
    )  # fmt: skip
    m.finish("cancelled", 2, 1, 0.1)
    m.abandon_queued()
    m.reject(400)
    text = m.render(waiting=2, running=1)
    assert "# TYPE monokernel_time_to_first_token_seconds histogram" in text
    assert 'monokernel_time_to_first_token_seconds_bucket{le="0.001"} 0' in text
    assert 'monokernel_time_to_first_token_seconds_bucket{le="0.005"} 1' in text
    assert 'monokernel_inter_token_latency_seconds_bucket{le="+Inf"} 2' in text
    assert 'monokernel_inter_token_latency_seconds_bucket{le="0.001"} 1' in text
    assert "monokernel_inter_token_latency_seconds_count 2" in text
    assert "monokernel_num_requests_waiting 2" in text
    assert "monokernel_prompt_tokens_total 16" in text
    assert "monokernel_generation_tokens_total 15" in text
    assert "monokernel_spec_decode_draft_tokens_total 12" in text
    assert "monokernel_spec_decode_accepted_tokens_total 7" in text
    assert 'monokernel_request_success_total{finished_reason="length"} 1' in text
    assert 'monokernel_request_rejected_total{status="400"} 1' in text
    assert "monokernel_request_abandoned_total 1" in text
    # vLLM's names, with the model label, as its dashboards query them.
    label = 'model_name="org/tiny"'
    assert f"vllm:num_requests_running{{{label}}} 1" in text
    assert f"vllm:prompt_tokens_total{{{label}}} 16" in text
    assert f'vllm:time_to_first_token_seconds_bucket{{{label},le="0.005"}} 1' in text
    assert f"vllm:time_per_output_token_seconds_count{{{label}}} 2" in text
    assert f"vllm:request_queue_time_seconds_count{{{label}}} 1" in text
    assert f"vllm:request_prefill_time_seconds_sum{{{label}}} 0.01" in text
    assert f"vllm:request_inference_time_seconds_count{{{label}}} 1" in text
    assert f'vllm:request_prompt_tokens_bucket{{{label},le="5"}} 2' in text
    assert f"vllm:prefix_cache_queries_total{{{label}}} 4" in text
    assert f"vllm:prefix_cache_hits_total{{{label}}} 3" in text
    # "cancelled" and requests abandoned in the queue are vLLM's "abort".
    assert f'vllm:request_success_total{{finished_reason="abort",{label}}} 2' in text
    assert f'vllm:request_success_total{{finished_reason="stop",{label}}} 1' in text
    assert "process_resident_memory_bytes " in text and "process_open_fds " in text
    # Every sample line parses as NAME{LABELS} VALUE.
    import re

    sample = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? \S+$')
    for line in text.splitlines():
        assert line.startswith("# ") or sample.match(line), line


def test_validation_message_names_the_field() -> None:
    errors = [{"type": "float_parsing", "loc": ("temperature",), "msg": "Bad", "input": "hot"}]
    assert validation_message(errors) == ("temperature: Bad (got 'hot')", "temperature")
    missing = [{"type": "missing", "loc": ("messages", 0, "role"), "msg": "Field required"}]
    assert validation_message(missing) == ("messages.0.role is required", "messages.0.role")


def test_timings_carry_the_draft_counts_only_when_speculating() -> None:
    from monokernel.runtime.engine import Timings
    from monokernel.serve.protocol import timings_json

    plain = timings_json(Timings(10, 5, 0.01, 0.04), 0.0)
    assert "draft_n" not in plain and "draft_n_accepted" not in plain
    spec = timings_json(Timings(10, 5, 0.01, 0.04, drafted_tokens=8, accepted_tokens=3), 0.0)
    assert spec["draft_n"] == 8 and spec["draft_n_accepted"] == 3


def test_cached_prompt_tokens_reach_timings_and_usage() -> None:
    from monokernel.runtime.engine import Timings
    from monokernel.serve.protocol import timings_json, usage

    assert "prompt_tokens_details" not in usage(10, 5)
    t = timings_json(Timings(10, 5, 0.01, 0.04, cached_tokens=6), 0.0)
    assert t["cache_n"] == 6
    assert usage(10, 5, t["cache_n"])["prompt_tokens_details"] == {"cached_tokens": 6}
