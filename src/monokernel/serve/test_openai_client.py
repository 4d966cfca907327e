"""The official ``openai`` client against a live server on the tiny model."""

from __future__ import annotations

import httpx
import pytest

from monokernel.serve.testing_names import MODEL_NAME

openai = pytest.importorskip("openai")

TIMING_KEYS = {
    "prompt_n",
    "prompt_per_second",
    "predicted_n",
    "predicted_per_second",
    "ttft_ms",
    "queue_ms",
}


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_completion(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL_NAME, prompt="def reverse(s):", max_tokens=12, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.prompt_tokens > 2
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    timings = (r.model_extra or {})["timings"]
    assert set(timings) >= TIMING_KEYS
    assert timings["predicted_n"] == r.usage.completion_tokens
    assert timings["prompt_n"] == r.usage.prompt_tokens


def test_chat(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Reverse a string in Python."},
        ],
        max_tokens=10,
        temperature=0.8,
        top_p=0.9,
        seed=7,
        extra_body={"top_k": 20},
    )
    again = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Reverse a string in Python."},
        ],
        max_tokens=10,
        temperature=0.8,
        top_p=0.9,
        seed=7,
        extra_body={"top_k": 20},
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == again.choices[0].message.content  # seeded
    assert r.usage is not None and r.usage.completion_tokens >= 1
    assert set((r.model_extra or {})["timings"]) >= TIMING_KEYS


def test_chat_default_max_tokens_is_rest_of_context(client: openai.OpenAI) -> None:
    # No max_tokens: ignore_eos makes it run to the end of the tiny 256-token context.
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage is not None
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 256
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_matches_non_streaming(client: openai.OpenAI, chat: bool) -> None:
    kwargs = {"model": MODEL_NAME, "max_tokens": 16, "temperature": 0}
    messages = [{"role": "user", "content": "Write a loop."}]
    if chat:
        whole = client.chat.completions.create(messages=messages, **kwargs)
        stream = client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs
        )
    else:
        whole = client.completions.create(prompt="for i in range(", **kwargs)
        stream = client.completions.create(
            prompt="for i in range(", stream=True, stream_options={"include_usage": True}, **kwargs
        )
    chunks = list(stream)
    text = "".join(
        (c.choices[0].delta.content or "") if chat else c.choices[0].text
        for c in chunks
        if c.choices
    )
    expected = whole.choices[0].message.content if chat else whole.choices[0].text
    assert text == expected
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert whole.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert set((last.model_extra or {})["timings"]) >= TIMING_KEYS


def test_streaming_without_usage_has_timings_last(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt="import torch", max_tokens=5, temperature=0, stream=True
        )
    )
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason is not None
    assert "timings" in (chunks[-1].model_extra or {})


@pytest.mark.parametrize("as_list", [False, True])
def test_stop_strings(client: openai.OpenAI, as_list: bool) -> None:
    prompt = "The quick brown fox"
    full = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0]
    text = full.text
    # A stop string from the middle of the greedy output, not found earlier in it.
    stop = next(
        text[i : i + 3]
        for i in range(4, len(text) - 3)
        if text[i : i + 3].strip() and text.find(text[i : i + 3]) == i
    )
    cut = text.index(stop)
    for stream in (False, True):
        r = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=40,
            temperature=0,
            stop=[stop, "\x00never"] if as_list else stop,
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        if stream:
            chunks = list(r)
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            got, finish = r.choices[0].text, r.choices[0].finish_reason
        assert got == text[:cut]
        assert finish == "stop"


def test_health_and_metrics(client: openai.OpenAI, base_url: str) -> None:
    client.completions.create(model=MODEL_NAME, prompt="x = 1", max_tokens=3, temperature=0)
    assert httpx.get(base_url + "/health").json()["status"] == "ok"
    text = httpx.get(base_url + "/metrics").text
    for name in (
        "monokernel_time_to_first_token_seconds_bucket",
        "monokernel_inter_token_latency_seconds_count",
        "monokernel_e2e_request_latency_seconds_sum",
        "monokernel_prompt_tokens_total",
        "monokernel_generation_tokens_total",
        "monokernel_num_requests_waiting",
    ):
        assert name in text
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["monokernel_generation_tokens_total"] >= 3
    assert values["monokernel_e2e_request_latency_seconds_count"] >= 1
    assert values['monokernel_time_to_first_token_seconds_bucket{le="+Inf"}'] >= 1


def test_logprobs_parse_in_the_clients_types(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    c = client.completions.create(
        model=MODEL_NAME, prompt="def f(", max_tokens=5, temperature=0, logprobs=3
    )
    lp = c.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == 5
    # A map by text: alternatives that decode alike (special tokens: "") share one key.
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
