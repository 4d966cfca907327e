"""The ``endpoint`` engine: any OpenAI-compatible server, timed at the client.

``POST /v1/completions`` with ``stream: true``; TTFT is request sent -> first chunk with
text, the decode time runs from that chunk to the last one and is divided over the tokens
the server reports in ``usage`` (or the chunks, when it sends no usage). Times therefore
include HTTP and SSE framing, as an agent talking to that server would see them.

httpx is used when installed (one kept-alive connection); otherwise the standard library's
urllib, so the bench imports with only torch and transformers present.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from monokernel.bench.measure import RunTiming

# Common words that most BPE vocabularies hold as single tokens (with the leading space), so a
# text prompt of n words is about n tokens; the server's usage gives the exact count.
_WORDS = (
    *("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on"),
    *("be", "by", "this", "are", "from", "at", "or", "an", "have", "not", "but", "all", "can"),
    *("more", "one", "will", "time", "new", "code", "file", "test", "data", "value", "list"),
    *("return", "function", "error", "line", "type", "name", "class", "object", "use", "user"),
    *("case", "each", "call", "run", "read", "write", "state", "model", "token"),
)


class EndpointError(RuntimeError):
    """The server could not be reached or answered with an error."""


def _pick_transport(transport: str) -> str:
    if transport not in ("auto", "httpx", "urllib"):
        raise ValueError(f"transport must be auto, httpx or urllib, got {transport!r}")
    if transport != "auto":
        return transport
    try:
        import httpx  # noqa: F401
    except ImportError:
        return "urllib"
    return "httpx"


def prompt_text(ids: list[int]) -> str:
    return "".join(" " + _WORDS[i % len(_WORDS)] for i in ids)


class EndpointRunner:
    name = "endpoint"

    def __init__(
        self,
        url: str,
        model: str | None = None,
        api_key: str | None = None,
        prompt_mode: str = "ids",
        transport: str = "auto",
        timeout_s: float = 600.0,
    ) -> None:
        if prompt_mode not in ("ids", "text"):
            raise ValueError(f"endpoint prompt must be ids or text, got {prompt_mode!r}")
        base = url.rstrip("/")
        self.base = base[: -len("/v1")] if base.endswith("/v1") else base
        self.prompt_mode = prompt_mode
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.transport = _pick_transport(transport)
        self._client: Any = None
        if self.transport == "httpx":
            import httpx

            self._client = httpx.Client(timeout=timeout_s, headers=self.headers)
        self.model = model or self._first_model()
        self.info: dict[str, Any] = {"endpoint": self.base, "endpoint_model": self.model}

    # ------------------------------------------------------------------ HTTP
    def _get_json(self, path: str) -> Any:
        url = self.base + path
        try:
            if self._client is not None:
                r = self._client.get(url)
                status, text = r.status_code, r.text
            else:
                req = urllib.request.Request(url, headers=self.headers)
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    status, text = resp.status, resp.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode("utf-8", "replace")
        except Exception as e:  # connection refused, DNS, timeout: one message for all
            raise EndpointError(f"could not reach {url}: {e}") from e
        if status != 200:
            raise EndpointError(f"GET {path} answered {status}: {text[:300]}")
        return json.loads(text)

    def _first_model(self) -> str:
        models = self._get_json("/v1/models").get("data") or []
        if not models:
            raise EndpointError("the endpoint lists no models; pass --endpoint-model")
        return str(models[0]["id"])

    @contextmanager
    def _post_lines(self, body: dict[str, Any]) -> Iterator[Iterator[str]]:
        url = self.base + "/v1/completions"
        if self._client is not None:
            import httpx

            try:
                with self._client.stream("POST", url, json=body) as r:
                    if r.status_code != 200:
                        r.read()
                        raise EndpointError(f"{url} answered {r.status_code}: {r.text[:500]}")
                    yield r.iter_lines()
            except httpx.HTTPError as e:
                raise EndpointError(f"request to {url} failed: {e}") from e
            return
        headers = {**self.headers, "Content-Type": "application/json"}
        req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
        try:
            resp = urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as e:
            detail = e.read().decode("utf-8", "replace")[:500]
            raise EndpointError(f"{url} answered {e.code}: {detail}") from e
        except urllib.error.URLError as e:
            raise EndpointError(f"could not reach {url}: {e.reason}") from e
        with resp:
            # Iterating the response reads line by line as the chunks arrive.
            yield (raw.decode("utf-8", "replace").rstrip("\r\n") for raw in resp)

    # ------------------------------------------------------------------ timing
    def run(self, prompt: list[int], gen_tokens: int) -> RunTiming:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt if self.prompt_mode == "ids" else prompt_text(prompt),
            "max_tokens": gen_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,  # vLLM's extra (llama.cpp and monokernel serve take it too)
        }
        usage: dict[str, Any] | None = None
        first = last = None
        chunks = 0
        start = time.perf_counter()
        with self._post_lines(body) as lines:
            for line in lines:
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    raise EndpointError(f"the endpoint sent an error: {chunk['error']}")
                usage = chunk.get("usage") or usage
                # A chunk without text (a finishing chunk, a held-back half character) is no
                # token arrival.
                if any(c.get("text") for c in chunk.get("choices") or []):
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    chunks += 1
        if first is None or last is None:
            raise EndpointError("the endpoint streamed no text")
        tokens = int(usage["completion_tokens"]) if usage else chunks
        if usage and usage.get("prompt_tokens") is not None:
            self.info["endpoint_prompt_tokens"] = int(usage["prompt_tokens"])
        return RunTiming(first - start, (last - first) / max(tokens - 1, 1), tokens)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
