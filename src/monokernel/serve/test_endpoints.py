"""CORS (--allowed-origins), /tokenize, /detokenize and /v1/models/{id} on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from monokernel.runtime.engine import Engine
from monokernel.serve import cli
from monokernel.serve.settings import ServerSettings
from monokernel.serve.testing_names import MODEL_NAME

ORIGIN = "https://app.example.com"


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=30) as client:
        yield client


def _preflight(client: httpx.Client, origin: str) -> httpx.Response:
    return client.options(
        "/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )


def test_no_cors_by_default(http: httpx.Client) -> None:
    r = _preflight(http, ORIGIN)
    assert r.status_code == 405
    assert "access-control-allow-origin" not in r.headers
    r = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("allowed", [(ORIGIN,), ("*",)])
def test_cors_preflight_and_response(engine: Engine, allowed: tuple[str, ...]) -> None:
    from monokernel.serve.app import create_app
    from monokernel.serve.testing import live_server, wait_ready

    settings = ServerSettings(MODEL_NAME, api_key="k", allowed_origins=allowed)
    with live_server(create_app(settings, lambda: engine)) as url:
        wait_ready(url)
        with httpx.Client(base_url=url, timeout=30) as client:
            r = _preflight(client, ORIGIN)  # no key: preflights carry no credentials
            assert r.status_code == 200, r.text
            assert r.headers["access-control-allow-origin"] in (ORIGIN, "*")
            assert "POST" in r.headers["access-control-allow-methods"]
            assert "authorization" in r.headers["access-control-allow-headers"].lower()
            body = {"model": MODEL_NAME, "prompt": "x =", "max_tokens": 2}
            ok = client.post(
                "/v1/completions",
                json=body,
                headers={"Origin": ORIGIN, "Authorization": "Bearer k"},
            )
            assert ok.status_code == 200, ok.text
            assert ok.headers["access-control-allow-origin"] in (ORIGIN, "*")
            # A refusal is readable by the page too.
            denied = client.post("/v1/completions", json=body, headers={"Origin": ORIGIN})
            assert denied.status_code == 401
            assert denied.headers["access-control-allow-origin"] in (ORIGIN, "*")
            if allowed != ("*",):
                other = _preflight(client, "https://evil.example.com")
                assert other.status_code == 400
                assert "access-control-allow-origin" not in other.headers


def test_allowed_origins_flag() -> None:
    args = cli.build_parser().parse_args(["--allowed-origins", f"{ORIGIN}/, http://localhost:3000"])
    assert args.allowed_origins == (ORIGIN, "http://localhost:3000")
    assert cli.build_parser().parse_args([]).allowed_origins == ()
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--allowed-origins", "app.example.com"])


def test_tokenize_and_detokenize(http: httpx.Client, engine: Engine) -> None:
    prompt = "def reverse(s): return s[::-1]"
    r = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": prompt})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens"] == engine.encode(prompt)
    assert out["count"] == len(out["tokens"])
    assert out["max_model_len"] == engine.max_model_len == 256
    assert out["token_strs"] is None
    # The count is what a completion of the same prompt is charged.
    done = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == out["count"]

    messages = [{"role": "user", "content": "hi there"}]
    chat = http.post("/tokenize", json={"messages": messages, "return_token_strs": True}).json()
    assert chat["tokens"] == engine.encode(messages)
    assert len(chat["token_strs"]) == chat["count"]
    done = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == chat["count"]

    back = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": out["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": engine.tokenizer.decode(out["tokens"])}
    assert prompt in back.json()["prompt"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": False}, 400, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "frob": 1}, 400, "frob"),
        ("/tokenize", {"prompt": "x" * 60_000}, 400, "prompt"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                       "add_generation_prompt": False}, 400, "add_generation_prompt"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0"),
        ("/detokenize", {"tokens": [1] * 300}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
    ],
)  # fmt: skip
def test_tokenize_refusals(
    http: httpx.Client, path: str, body: dict[str, object], status: int, param: str
) -> None:
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param


def test_retrieve_model(http: httpx.Client) -> None:
    r = http.get(f"/v1/models/{MODEL_NAME}")
    assert r.status_code == 200, r.text
    card = r.json()
    assert (card["id"], card["object"], card["max_model_len"]) == (MODEL_NAME, "model", 256)
    missing = http.get("/v1/models/org/gpt-4")
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["code"] == "model_not_found" and "'org/gpt-4' does not exist" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_retrieve_model_with_a_slash(engine: Engine) -> None:
    from monokernel.serve.app import create_app
    from monokernel.serve.testing import live_server, wait_ready

    name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    with live_server(create_app(ServerSettings(name), lambda: engine)) as url:
        wait_ready(url)
        r = httpx.get(f"{url}/v1/models/{name}")
        assert r.status_code == 200 and r.json()["id"] == name


def test_tokenize_needs_the_api_key(engine: Engine) -> None:
    from monokernel.serve.app import create_app
    from monokernel.serve.testing import live_server, wait_ready

    with live_server(create_app(ServerSettings(MODEL_NAME, api_key="k"), lambda: engine)) as url:
        wait_ready(url)
        assert httpx.post(url + "/tokenize", json={"prompt": "x"}).status_code == 401
        r = httpx.post(
            url + "/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer k"}
        )
        assert r.status_code == 200
