"""A model's tokenizer without `transformers`: its `tokenizer.json` through the `tokenizers`
library and its chat template through jinja2, for a start that only encodes, renders a chat
and decodes.

Importing transformers and building its tokenizer is ~3 s of a 2-core CPU start; this is
~0.1 s. It stands in for transformers only where it was shown to agree with it: when a
cached tokenizer entry is first loaded through transformers, ``probe`` renders and encodes a
few prompts both ways and writes the answer into the entry (``MARKER``, with the library
versions it was checked with); only an entry marked as agreeing is read this way
afterwards, and no entry is probed twice under the same libraries. Anything beyond the
three operations (tools in templates, the vocabulary, token strings) loads transformers'
tokenizer on first use (tokenizer.Tokenizer.hf).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

# In an entry: the library versions it was probed under and the answer, one line.
MARKER = "light.probe"
_AGREES, _DIFFERS = "agrees", "differs"

# Chats and texts both ways must agree on: the template's branches for a first system
# message or none, several turns, text that spells a special token, non-ASCII and spacing.
_PROBE_CHATS: tuple[list[dict[str, str]], ...] = (
    [{"role": "user", "content": "Write a Python function that adds."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Explain recursion in one sentence."},
    ],
    [
        {"role": "user", "content": "  two  spaces\tand a tab\n\nnew lines"},
        {"role": "assistant", "content": "Ünïcödé — 漢字 🙂 <|im_end|> ok"},
        {"role": "user", "content": "def f(x):\n    return x * 2"},
    ],
)
_PROBE_TEXTS: tuple[str, ...] = (
    "def reverse(s):",
    " leading space, trailing space ",
    "Ünïcödé — 漢字 🙂",
    "<|im_start|>user\nhi<|im_end|>",
    "",
)


def versions() -> str:
    """What a light entry's agreement depends on besides the entry itself."""
    names = ("transformers", "tokenizers", "jinja2")
    return " ".join(f"{n}-{metadata.version(n)}" for n in names)


class LightTokenizer:
    """An entry's tokenizer.json, tokenizer_config.json and chat template (the files
    transformers' save_pretrained wrote)."""

    def __init__(self, entry: Path) -> None:
        from tokenizers import Tokenizer as FastTokenizer

        self.fast = FastTokenizer.from_file(str(entry / "tokenizer.json"))
        config = json.loads((entry / "tokenizer_config.json").read_text())
        template = entry / "chat_template.jinja"
        self.chat_template: str | None = (
            template.read_text() if template.is_file() else config.get("chat_template")
        )
        # The special tokens a template may name ({{ bos_token }}), as transformers passes them.
        self.special_tokens = {
            k: _token_text(v)
            for k, v in config.items()
            if k.endswith("_token") and _token_text(v) is not None
        }
        self._template: Any = None

    def __len__(self) -> int:
        return int(self.fast.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.fast.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.fast.decode(list(ids), skip_special_tokens=True))

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        """The chat through the template, a generation prompt after it."""
        if self._template is None:
            self._template = _environment().from_string(self.chat_template or "")
        return str(
            self._template.render(
                messages=list(messages),
                tools=None,
                documents=None,
                add_generation_prompt=True,
                **self.special_tokens,
            )
        )


def probe(hf: Any, entry: Path) -> bool:
    """Whether the light tokenizer of ``entry`` renders, encodes and decodes the probes as
    ``hf`` (transformers' tokenizer of the same entry) does. The answer is written into the
    entry either way (MARKER), so an entry is probed once for the installed libraries."""
    agrees = _agrees(hf, entry)
    # A cache that cannot be written costs only the next start's time.
    with contextlib.suppress(OSError):
        (entry / MARKER).write_text(f"{versions()} {_AGREES if agrees else _DIFFERS}\n")
    return agrees


def _agrees(hf: Any, entry: Path) -> bool:
    try:
        light = LightTokenizer(entry)
        if len(light) != len(hf):
            return False
        texts = list(_PROBE_TEXTS)
        if getattr(hf, "chat_template", None):
            for chat in _PROBE_CHATS:
                want = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                if light.render_chat(chat) != want:
                    return False
                texts.append(want)
        for text in texts:
            for special in (True, False):
                ids = list(hf(text, add_special_tokens=special)["input_ids"])
                if light.encode(text, special) != ids:
                    return False
                if light.decode(ids) != hf.decode(ids, skip_special_tokens=True):
                    return False
        return True
    except Exception:  # a probe that fails for any reason means "differs"
        return False


def _result(entry: Path) -> str | None:
    """The probe's answer for the installed libraries, None when not probed under them."""
    try:
        line = (entry / MARKER).read_text().strip()
        mine = versions()
    except (OSError, metadata.PackageNotFoundError):
        return None
    found, _, answer = line.rpartition(" ")
    return answer if found == mine else None


def marked(entry: Path) -> bool:
    """Whether ``entry`` agreed with transformers under the libraries installed now."""
    return _result(entry) == _AGREES


def probed(entry: Path) -> bool:
    """Whether ``entry`` was probed under the libraries installed now, whatever the answer."""
    return _result(entry) is not None


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _environment() -> Any:
    """A sandboxed jinja2 environment set up as transformers sets up its own for chat
    templates: blocks trimmed, loop controls, a tojson that keeps non-ASCII and HTML as is,
    raise_exception and strftime_now."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
