"""What the structured-output tests of every API share: a chat template that takes tools in
few tokens, the schemas the forced calls and formats use, and the server they run on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from monokernel.runtime.engine import Engine, EngineConfig
from monokernel.runtime.speculative import SpeculativeConfig
from monokernel.serve.app import create_app
from monokernel.serve.settings import ServerSettings
from monokernel.serve.testing import live_server, wait_ready
from monokernel.serve.testing_names import MODEL_NAME
from monokernel.testing.tiny_models import CHATML_TEMPLATE


def as_speculative(monkeypatch: Any, engine: Engine) -> None:
    """Make ``engine`` run with --speculative from now on (until the test ends), as a
    server started with it does: its backend drafts."""
    config = SpeculativeConfig()
    monkeypatch.setattr(engine, "speculative", config)
    monkeypatch.setattr(engine.backend, "speculative", config)


# Short, so prompt and reply fit the tiny model's 256 positions; Hermes's <tool_call>
# marker tells the server the format.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t.function.name }} "
    "{% endfor %}</tools> Reply with <tool_call></tool_call>.<|im_end|>\n{% endif %}"
    + CHATML_TEMPLATE
)
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ZONE = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
USER = [{"role": "user", "content": "Weather?"}]


def matches_schema(value: Any) -> bool:
    """Whether ``value`` is an object SCHEMA accepts."""
    return (
        isinstance(value, dict)
        and set(value) == {"city", "days"}
        and value["city"] in ("Paris", "Rome")
        and type(value["days"]) is int
        and 1 <= value["days"] <= 7
    )


@contextlib.contextmanager
def structured_server(
    tiny_model_dir: Path, template: str = TOOLS_TEMPLATE
) -> Iterator[tuple[Engine, str]]:
    """The reference engine on the tiny model with ``template``, served on loopback."""
    eng = Engine(tiny_model_dir, EngineConfig(engine="reference", device="cpu", progress=False))
    eng.tokenizer.hf.chat_template = template
    with live_server(create_app(ServerSettings(MODEL_NAME), lambda: eng)) as url:
        wait_ready(url)
        yield eng, url
