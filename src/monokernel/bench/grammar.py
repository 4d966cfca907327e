"""The grammar of ``monokernel bench --grammar REGEX``: a fresh matcher for each request of a
``+grammar`` engine (``monokernel+grammar``), so the cost of constrained decoding is timed
beside the same engine unconstrained.

With ``--model`` the grammar runs over the model's own tokenizer. A named ``--shape`` has
random weights and no tokenizer: the grammar then runs over a small byte-level BPE tokenizer
(testing/tiny_models.py) padded to the shape's vocabulary, whose ids beyond its own are never
allowed; the mask is just as wide, so the kernel and the host do the same work a real
tokenizer's mask would ask of them (llguidance's mask computation is cheaper over a small
vocabulary, which only helps the host keep ahead of the kernel).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from monokernel.runtime.constrained import Constraint, GrammarCompiler, TokenMatcher


def matcher_factory(
    regex: str, vocab_size: int, tokenizer_dir: Path | None, gguf_file: str | None = None
) -> Callable[[], TokenMatcher]:
    """Fresh matchers of ``regex`` over the model's tokenizer (``tokenizer_dir``, with the
    GGUF file holding it if any), or the padded tiny one when ``tokenizer_dir`` is None;
    ConstraintError now for a regex llguidance refuses or a missing llguidance."""
    if tokenizer_dir is None:
        hf, eos = _tiny_tokenizer()
    else:
        from monokernel.tokenizer.tokenizer import Tokenizer

        tok = Tokenizer.load(tokenizer_dir, gguf_file)
        hf, eos = tok.hf, [tok.hf.eos_token_id]
    compiler = GrammarCompiler(hf, vocab_size, eos)
    constraint = Constraint.regex(regex)
    compiler.matcher(constraint)  # refuses a bad regex before any engine opens
    return lambda: compiler.matcher(constraint)


def _tiny_tokenizer() -> tuple[object, list[int]]:
    import transformers

    from monokernel.testing.tiny_models import make_tiny_tokenizer

    directory = Path(tempfile.mkdtemp(prefix="mk-bench-tokenizer-"))
    make_tiny_tokenizer(directory)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    return hf, [hf.eos_token_id]
