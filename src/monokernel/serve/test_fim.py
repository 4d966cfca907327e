"""Fill in the middle (fim.py): a completion's ``suffix`` laid out prefix-suffix-middle
with the model's FIM tokens, on the tiny model given Qwen2.5-Coder's markers; a model
without them is refused naming ``suffix`` (test_strict.py)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from monokernel.runtime.engine import Engine
from monokernel.serve.app import create_app
from monokernel.serve.errors import APIError
from monokernel.serve.fim import FIM_MARKERS, fim_markers, fim_prompt
from monokernel.serve.settings import ServerSettings
from monokernel.serve.testing import live_server, scripted_engine, wait_ready

QWEN = FIM_MARKERS[0]


@pytest.fixture(scope="module")
def fim_engine(tiny_model_dir: Path) -> Engine:
    eng = scripted_engine(tiny_model_dir, "{{ messages[0]['content'] }}")
    eng.tokenizer.hf.add_special_tokens({"additional_special_tokens": list(QWEN)})
    return eng


def test_the_prompt_is_prefix_suffix_middle(fim_engine: Engine) -> None:
    hf = fim_engine.tokenizer.hf
    begin, hole, middle = (hf.convert_tokens_to_ids(t) for t in QWEN)
    assert fim_markers(hf) == (begin, hole, middle)

    def text(t: str) -> list[int]:
        return list(hf(t, add_special_tokens=False)["input_ids"])

    got = fim_prompt(fim_engine, "def add(a, b):\n    ", "\n\nprint(add(1, 2))")
    assert got == [
        begin,
        *text("def add(a, b):\n    "),
        hole,
        *text("\n\nprint(add(1, 2))"),
        middle,
    ]
    assert fim_prompt(fim_engine, ["x = "], "y") == [begin, *text("x = "), hole, *text("y"), middle]


@pytest.mark.parametrize("prompt", [[1, 2, 3], ["a", "b"]])
def test_a_prompt_that_is_not_one_text_is_refused(fim_engine: Engine, prompt: object) -> None:
    with pytest.raises(APIError) as e:
        fim_prompt(fim_engine, prompt, "y")
    assert e.value.status == 400 and e.value.param == "suffix"


def test_the_server_completes_the_middle(fim_engine: Engine) -> None:
    settings = ServerSettings("tiny")
    with live_server(create_app(settings, lambda: fim_engine)) as url:
        wait_ready(url)
        served = httpx.Client(base_url=url, timeout=30)
        hf = fim_engine.tokenizer.hf
        fim_engine.backend.script = [  # type: ignore[attr-defined]
            *hf("a + b", add_special_tokens=False)["input_ids"],
            min(fim_engine.eos_token_ids),
        ]
        body = {"model": "tiny", "prompt": "def add(a, b):\n    return ", "suffix": "\n"}
        r = served.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["text"] == "a + b"
        want = fim_prompt(fim_engine, body["prompt"], body["suffix"])
        assert out["usage"]["prompt_tokens"] == len(want)
