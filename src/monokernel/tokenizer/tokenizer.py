"""The model's own tokenizer and chat template, through `transformers.AutoTokenizer`.

Using HF's tokenizer is deliberate: a raw prompt must tokenise exactly as `transformers`
does by default, and a chat must go through the checkpoint's own template.

A GGUF file carries its tokenizer as metadata, which transformers converts on every load by
parsing the whole file again (8-17 s for the default model on 2 cores, the bulk of a
start). The converted tokenizer is saved once under ``<cache>/tokenizers/<key>/`` and later
starts load those files (under a second). The key is the sha256 of the GGUF's header (all
metadata and the tensor table, read by our loader's parse anyway) with the transformers
version, so a copy of the file hits the entry and an edited file or a transformers that
converts differently does not. An entry shown to agree with transformers on a few probes is
read without importing transformers at all on later starts (light.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from monokernel.errors import InvalidRequestError, ModelNotFoundError
from monokernel.tokenizer import light as light_entry
from monokernel.tokenizer.light import LightTokenizer
from monokernel.weights.progress import slow_step

# Bump when what is saved changes shape, so old entries are not read as new ones.
CACHE_FORMAT = 1
# What a complete entry holds; save_pretrained writes more (e.g. chat_template.jinja) as the
# tokenizer has it, and the entry is only renamed into place once all of it is written.
_ENTRY_MARKER = "tokenizer_config.json"

ChatMessage = dict[str, Any]
Prompt = str | Sequence[ChatMessage]


class Tokenizer:
    """``hf``: transformers' tokenizer; or ``light`` (light.py, an entry shown to agree with
    transformers) with ``hf_from`` building transformers' on first use of ``hf``. Once
    ``hf`` exists every call goes through it: a caller that reached for it (the server's
    tools, a test setting a template) sees its own changes."""

    def __init__(
        self,
        hf_tokenizer: Any = None,
        *,
        light: LightTokenizer | None = None,
        hf_from: Callable[[], Any] | None = None,
    ) -> None:
        if hf_tokenizer is None and (light is None or hf_from is None):
            raise ValueError(
                "a Tokenizer needs transformers' tokenizer, or a light one and a way to it"
            )
        self._hf = hf_tokenizer
        self._light = light
        self._hf_from = hf_from

    @property
    def hf(self) -> Any:
        """transformers' tokenizer, built now if the light one stood in so far."""
        if self._hf is None:
            assert self._hf_from is not None
            self._hf = self._hf_from()
        return self._hf

    @property
    def _fast(self) -> LightTokenizer | None:
        return self._light if self._hf is None else None

    @classmethod
    def load(
        cls,
        directory: Path,
        gguf_file: str | None = None,
        *,
        progress: bool = False,
        cache_dir: Path | None = None,
    ) -> Tokenizer:
        """The tokenizer of an HF directory, or of ``directory/gguf_file``.

        GGUF: from the cache entry when there is one, else converted by transformers and
        saved there (``cache_dir``, default ``<MONOKERNEL_CACHE>/tokenizers``). ``progress``
        says on stderr when that slow first conversion runs.
        """
        if gguf_file is None:
            return cls(_from_pretrained(str(directory)))
        gguf_path = Path(directory) / gguf_file
        entry = gguf_tokenizer_entry(gguf_path, cache_dir)
        if entry is not None and (entry / _ENTRY_MARKER).is_file():
            if light_entry.marked(entry):
                try:
                    where = str(entry)
                    return cls(light=LightTokenizer(entry), hf_from=lambda: _from_pretrained(where))
                except Exception:  # an unreadable light entry: transformers' below
                    pass
            try:
                hf = _from_pretrained(str(entry))
                if not light_entry.probed(entry):
                    light_entry.probe(hf, entry)  # the next start may skip transformers
                return cls(hf)
            except ModelNotFoundError:
                # A damaged entry: convert again and replace it.
                shutil.rmtree(entry, ignore_errors=True)
        note = f"building the tokenizer from {gguf_file} (first run; cached afterwards)"
        with slow_step(note, progress):
            hf = _from_pretrained(str(directory), gguf_file=gguf_file)
        if entry is not None:
            _save_entry(hf, entry)
            if (entry / _ENTRY_MARKER).is_file():
                light_entry.probe(hf, entry)
        return cls(hf)

    @property
    def vocab_size(self) -> int:
        fast = self._fast
        return len(fast) if fast is not None else len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        fast = self._fast
        if fast is not None:
            return bool(fast.chat_template)
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """As `transformers` does by default: special tokens (BOS) added where the model
        adds them."""
        fast = self._fast
        if fast is not None:
            return fast.encode(text, add_special_tokens=True)
        return list(self.hf(text, add_special_tokens=True)["input_ids"])

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        if not self.has_chat_template:
            raise InvalidRequestError(
                "this model's tokenizer has no chat template; send a plain prompt instead"
            )
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidRequestError(
                    "each chat message must be an object with 'role' and 'content'"
                )
        # The template writes BOS and the like as text: no special tokens added after it.
        fast = self._fast
        if fast is not None:
            return fast.encode(fast.render_chat(messages), add_special_tokens=False)
        text = self.hf.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt)
        return self.encode_chat(prompt)

    def decode(self, ids: Sequence[int]) -> str:
        fast = self._fast
        if fast is not None:
            return fast.decode(ids)
        return self.hf.decode(list(ids), skip_special_tokens=True)


def _from_pretrained(where: str, gguf_file: str | None = None) -> Any:
    import transformers

    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        return transformers.AutoTokenizer.from_pretrained(where, **kwargs)
    except (OSError, ValueError) as e:
        shown = f"{where}/{gguf_file}" if gguf_file else where
        raise ModelNotFoundError(f"could not load a tokenizer from {shown}: {e}") from e


def gguf_tokenizer_entry(gguf_path: Path, cache_dir: Path | None = None) -> Path | None:
    """The cache folder for ``gguf_path``'s converted tokenizer (it may not exist yet);
    None when the file cannot be parsed (transformers then reports the problem)."""
    from monokernel.errors import WeightLoadError
    from monokernel.weights.gguf_file import read_gguf

    try:
        digest = read_gguf(gguf_path).header_digest()
    except (OSError, WeightLoadError):
        return None
    key = hashlib.sha256(
        f"{digest}:transformers-{_converter_version()}:format-{CACHE_FORMAT}".encode()
    ).hexdigest()[:32]
    if cache_dir is None:
        from monokernel.weights.default_model import cache_root

        cache_dir = cache_root() / "tokenizers"
    return Path(cache_dir) / key


def _converter_version() -> str:
    """The version of what converts a GGUF's tokenizer: part of the cache key (read from
    the installed metadata: importing transformers is ~2 s of a CPU start)."""
    return metadata.version("transformers")


def _save_entry(hf: Any, entry: Path) -> None:
    """Write the entry beside its final place and rename it in, so a concurrent start sees
    no entry or a whole one. A cache that cannot be written costs only the next start's
    time, so failures are ignored."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=entry.name + ".", suffix=".part"))
    except OSError:
        return
    try:
        hf.save_pretrained(str(tmp))
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the cache is as shareable as its models
        os.replace(tmp, entry)
    except (OSError, ValueError, TypeError):
        pass  # e.g. another process renamed its entry in first: that one serves as well
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
