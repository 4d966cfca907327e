"""A server whose engine speculates (--speculative ngram): same text, drafts counted in the
response's timings and in /metrics."""

from __future__ import annotations

from pathlib import Path

import httpx

from monokernel.runtime.engine import Engine, EngineConfig
from monokernel.runtime.sampling import SamplingParams
from monokernel.runtime.speculative import SpeculativeConfig
from monokernel.serve.settings import ServerSettings
from monokernel.serve.testing_names import MODEL_NAME


def test_speculating_server_reports_drafts(tiny_model_dir: Path, engine: Engine) -> None:
    from monokernel.serve.app import create_app
    from monokernel.serve.testing import live_server, wait_ready

    config = EngineConfig(
        engine="reference",
        device="cpu",
        progress=False,
        speculative=SpeculativeConfig(ngram_min=1),
    )
    fast = Engine(tiny_model_dir, config)
    body = {
        "model": MODEL_NAME,
        "prompt": "one two three one two three one two",
        "max_tokens": 24,
        "temperature": 0,
    }
    with live_server(create_app(ServerSettings(MODEL_NAME), lambda: fast)) as url:
        wait_ready(url)
        got = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        metrics = httpx.get(url + "/metrics", timeout=30).text
    want = engine.complete(body["prompt"], SamplingParams(max_tokens=24, temperature=0.0))
    assert got["choices"][0]["text"] == want.text
    t = got["timings"]
    assert t["draft_n"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"]
    assert f"monokernel_spec_decode_draft_tokens_total {t['draft_n']}" in metrics
