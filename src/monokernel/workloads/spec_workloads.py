"""Agent-shaped prompts for speculative decoding (issue 36): where n-gram drafts should pay,
and where they should cost nothing.

- ``spec-edit``: "apply this change and return the whole file" over a 263-line Python
  module; the answer is the file again with a few lines changed, so nearly every token of it
  is a copy of the prompt.
- ``spec-tool``: a 63-line pytest log to repeat verbatim, then a one-sentence summary: a
  long copy followed by free text.
- ``spec-chat``: three open questions, one request each; nothing in the prompt to copy.

The inputs are packaged texts (``workloads/texts/spec_*.txt``); every request is a list of
chat messages, rendered by the model's chat template as ``run --chat`` renders its prompt.
``monokernel bench --workload`` runs them (bench/spec.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from monokernel.runtime.perplexity import read_text

Message = dict[str, str]

# The inputs' paths in the package (perplexity.read_text reads the packaged texts).
EDIT_SOURCE: tuple[str, ...] = ("texts", "spec_edit_source.txt")
TOOL_OUTPUT: tuple[str, ...] = ("texts", "spec_tool_output.txt")
CHAT_QUESTIONS: tuple[str, ...] = ("texts", "spec_chat_questions.txt")

# An agent's requests carry its own system prompt; these say what an answer must hold. With
# the default model (SmolLM2-135M) the wording matters: a longer change request, or one
# placed before the file, makes it describe the code instead of re-emitting it (measured
# while writing this, 2026-11-26), so the request is short and follows the file.
EDIT_SYSTEM = (
    "You are a coding assistant. When asked to edit a file, you reply with the complete "
    "updated file and nothing else."
)
# The change asked of the edited file: small (a field and a cap), so the answer is the file
# again with a few lines new, as an agent's whole-file rewrite usually is.
EDIT_REQUEST = (
    "Add a field `max_delay_s: float = 300.0` to `RetryPolicy` and cap the value `delay()` "
    "returns at it. Reply with the complete updated file."
)
TOOL_SYSTEM = (
    "You are a coding assistant. When asked to report a tool's output, you reply with the "
    "complete output exactly as given, then one sentence about it."
)
TOOL_REQUEST = "Reply with the complete test output, then one sentence on what failed."

# Generated tokens a request may take at most, per workload: the edit must have room for the
# whole file (~2,300 tokens with SmolLM2's tokenizer) and some slack; the tool workload for
# the log (~1,430) and its summary; a chat answer is cut at 512.
EDIT_MAX_TOKENS = 3072
TOOL_MAX_TOKENS = 2048
CHAT_MAX_TOKENS = 512


@dataclass(frozen=True, slots=True)
class SpecWorkload:
    """One workload: its requests (each a chat) and how many tokens each may generate."""

    name: str
    description: str
    requests: tuple[tuple[Message, ...], ...]
    max_tokens: int
    # What a faithful answer repeats (the file, the log); None where nothing should be. The
    # bench reports how much of it the output holds, so a high acceptance that comes from
    # the model looping on its own words is not read as copying.
    copy_text: str | None = None

    def __post_init__(self) -> None:
        if not self.requests or self.max_tokens < 2:
            raise ValueError("a workload needs at least one request and max_tokens >= 2")


def _copy_workload(
    name: str,
    what: str,
    text: tuple[str, ...],
    fence: str,
    system: str,
    request: str,
    max_tokens: int,
) -> SpecWorkload:
    """One request whose answer should re-emit the packaged ``text``: under ``system``, the
    text in a ``fence`` code block, then ``request``."""
    body = read_text(text)
    messages = (
        {"role": "system", "content": system},
        {"role": "user", "content": f"```{fence}\n{body}```\n\n{request}"},
    )
    return SpecWorkload(name, what, (messages,), max_tokens, copy_text=body)


def edit_workload() -> SpecWorkload:
    return _copy_workload(
        "spec-edit",
        "apply a small change to a 263-line Python file and return the whole file",
        EDIT_SOURCE,
        "python",
        EDIT_SYSTEM,
        EDIT_REQUEST,
        EDIT_MAX_TOKENS,
    )


def tool_workload() -> SpecWorkload:
    return _copy_workload(
        "spec-tool",
        "repeat a 63-line pytest log verbatim, then summarise it",
        TOOL_OUTPUT,
        "text",
        TOOL_SYSTEM,
        TOOL_REQUEST,
        TOOL_MAX_TOKENS,
    )


def chat_questions() -> list[str]:
    """The chat workload's questions: the packaged text's paragraphs."""
    paragraphs = read_text(CHAT_QUESTIONS).split("\n\n")
    return [" ".join(p.split()) for p in paragraphs if p.strip()]


def chat_workload() -> SpecWorkload:
    return SpecWorkload(
        "spec-chat",
        "free-form chat: open questions, one request each",
        tuple(({"role": "user", "content": q},) for q in chat_questions()),
        CHAT_MAX_TOKENS,
    )


def copied_lines(output: str, copy_text: str) -> tuple[int, int]:
    """(distinct non-blank lines of ``copy_text`` that ``output`` holds as lines, distinct
    non-blank lines of ``copy_text``), leading and trailing blanks ignored: how much of the
    file or log the answer re-emitted, whatever its acceptance says."""
    wanted = {line.strip() for line in copy_text.splitlines() if line.strip()}
    found = {line.strip() for line in output.splitlines()} & wanted
    return len(found), len(wanted)


WORKLOADS: dict[str, Callable[[], SpecWorkload]] = {
    "spec-edit": edit_workload,
    "spec-tool": tool_workload,
    "spec-chat": chat_workload,
}


def build(name: str) -> SpecWorkload:
    """The workload ``name`` (a key of WORKLOADS); ValueError naming the choices."""
    try:
        return WORKLOADS[name]()
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}") from None
