"""Streaming detokenisation never splits a character and adds up to the full decode."""

from __future__ import annotations

import pytest

from monokernel.testing.tiny_models import make_tiny_tokenizer
from monokernel.tokenizer.detokenize import IncrementalDetokenizer
from monokernel.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp("tok")
    make_tiny_tokenizer(d)
    return Tokenizer.load(d)


@pytest.mark.parametrize("text", ["plain ascii text", "Ünïcödé ✓ 日本語 テキスト 🦀 end"])
def test_stream_equals_full_decode_and_never_splits(tok: Tokenizer, text: str) -> None:
    prompt = tok.encode("Say:")
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_a_character_cut_off_at_the_end_is_not_emitted(tok: Tokenizer) -> None:
    ids = tok.encode("🦀")
    assert len(ids) > 1  # a 4-byte character in a tiny byte-level vocab spans tokens
    detok = IncrementalDetokenizer(tok, [])
    pieces = [detok.add(i) for i in ids[:-1]] + [detok.flush()]
    assert "".join(pieces) == ""


def test_chat_template_and_plain_encoding(tok: Tokenizer) -> None:
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert tok.hf.decode(ids).endswith("<|im_start|>assistant\n")
    assert tok.encode("hi") == tok.hf("hi")["input_ids"]
