"""The speculative-decoding workloads (spec_workloads.py): their texts, messages and sizes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from monokernel.testing.tiny_models import make_tiny_model_dir
from monokernel.tokenizer.tokenizer import Tokenizer
from monokernel.workloads.spec_workloads import (
    EDIT_SOURCE,
    TOOL_OUTPUT,
    WORKLOADS,
    build,
    chat_questions,
    copied_lines,
    read_text,
)


def test_edit_workload_holds_the_whole_module_and_a_change_not_yet_made() -> None:
    source = read_text(EDIT_SOURCE)
    ast.parse(source)  # a real Python module, not something the model could not re-emit
    assert 200 <= len(source.splitlines()) <= 400
    w = build("spec-edit")
    ((system, user),) = w.requests
    assert system["role"] == "system" and user["role"] == "user"
    assert f"```python\n{source}```" in user["content"]
    # The change names what the file has and asks for what it lacks.
    assert "class RetryPolicy" in source and "def delay(" in source
    assert "max_delay_s" in user["content"] and "max_delay_s" not in source
    assert w.copy_text == source
    assert w.max_tokens >= 2048  # room for the whole file again


def test_tool_workload_repeats_a_pytest_log() -> None:
    log = read_text(TOOL_OUTPUT)
    assert 50 <= len(log.splitlines()) <= 80
    assert "2 failed, 22 passed" in log and log.count("PASSED") == 22
    w = build("spec-tool")
    ((_, user),) = w.requests
    assert f"```text\n{log}```" in user["content"]
    assert w.copy_text == log


def test_chat_workload_is_open_questions_one_request_each() -> None:
    questions = chat_questions()
    assert 2 <= len(questions) <= 3
    w = build("spec-chat")
    assert [r[0]["content"] for r in w.requests] == questions
    assert all(len(r) == 1 and r[0]["role"] == "user" for r in w.requests)
    assert all("?" in q or q.startswith("Explain") for q in questions)
    assert not any("```" in q for q in questions)
    assert w.copy_text is None


def test_unknown_workload_names_the_choices() -> None:
    with pytest.raises(ValueError, match="spec-edit, spec-tool, spec-chat"):
        build("spec-nope")


def test_copied_lines_counts_distinct_lines_of_the_text() -> None:
    text = "a = 1\n\n    b = 2\nc = 3\n"
    assert copied_lines("a = 1\nb = 2\nb = 2\nzzz\n", text) == (2, 3)
    assert copied_lines("", text) == (0, 3)


def test_prompts_render_through_a_chat_template(tmp_path: Path) -> None:
    tok = Tokenizer.load(make_tiny_model_dir("llama3", tmp_path / "tiny"), None, progress=False)
    sizes = {}
    for name in WORKLOADS:
        w = build(name)
        ids = [tok.encode_prompt(list(r)) for r in w.requests]
        text = tok.decode(ids[0])  # the template's markers are special tokens, not shown
        assert w.requests[0][-1]["content"] in text and text.endswith("\nassistant\n")
        sizes[name] = max(len(i) for i in ids)
        if w.copy_text is not None:  # the whole text is in the prompt
            assert len(ids[0]) > len(tok.encode(w.copy_text))
    assert sizes["spec-edit"] > sizes["spec-tool"] > 5 * sizes["spec-chat"]


@pytest.mark.slow
def test_sizes_with_the_default_models_tokenizer() -> None:
    """With SmolLM2's tokenizer: the sizes the docs and the token caps assume."""
    from monokernel.errors import ModelNotFoundError
    from monokernel.weights.default_model import default_model_path

    try:
        path = default_model_path(progress=False)
    except ModelNotFoundError as e:
        pytest.skip(f"default model unavailable (offline?): {e}")
    tok = Tokenizer.load(path.parent, path.name, progress=False)
    edit, tool, chat = (build(n) for n in ("spec-edit", "spec-tool", "spec-chat"))
    source_tokens = len(tok.encode(read_text(EDIT_SOURCE)))
    assert 2000 <= source_tokens <= 3000
    assert edit.max_tokens >= source_tokens + 256  # the file again, and the change
    assert tool.max_tokens >= len(tok.encode(read_text(TOOL_OUTPUT))) + 256
    for w in (edit, tool, chat):
        for r in w.requests:
            assert len(tok.encode_prompt(list(r))) + w.max_tokens + 1 <= 8192  # its context
    assert all(len(tok.encode_prompt(list(r))) < 128 for r in chat.requests)
