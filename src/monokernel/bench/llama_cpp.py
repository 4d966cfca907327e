"""The ``llama.cpp`` engine: llama-cpp-python on the same GGUF file, in this process.

The CPU's yardstick: the file the engines load, the same prompt token ids (a GGUF's
vocabulary is the tokenizer ours build from it), greedy, EOS ignored, ``threads`` threads
(the bench passes torch's, so both sides get the same cores). Timed as
``measure.time_request`` times our backends: TTFT from the call to the first token (prompt
evaluation and the first sample), then the decode rate over the remaining tokens.

Optional: ``pip install llama-cpp-python`` (it builds llama.cpp from source; minutes on 2
cores). The import happens when the engine is opened, so the bench runs without it.
"""

from __future__ import annotations

import time
from typing import Any

from monokernel.bench.measure import RunTiming, time_tokens

ENGINE = "llama.cpp"
INSTALL_HINT = "engine 'llama.cpp' needs llama-cpp-python: pip install llama-cpp-python"


def available() -> bool:
    """Whether llama-cpp-python can be imported here."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class LlamaCppRunner:
    name = ENGINE

    def __init__(self, gguf_path: str, max_len: int, threads: int) -> None:
        from llama_cpp import Llama, __version__

        self.llm = Llama(
            model_path=gguf_path,
            n_ctx=max_len,
            n_threads=threads,
            n_threads_batch=threads,
            n_gpu_layers=0,
            verbose=False,
        )
        self.info: dict[str, Any] = {"llama_cpp_version": __version__, "threads": threads}

    def run(self, prompt: list[int], gen_tokens: int) -> RunTiming:
        # Without a reset, generate() would reuse the part of the KV cache that matches the
        # previous request's tokens; every request here starts from an empty cache, as our
        # torch and reference engines do.
        self.llm.reset()
        stream = self.llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0)
        t0 = time.perf_counter()
        try:
            return time_tokens(stream, t0, gen_tokens)
        finally:
            stream.close()

    def close(self) -> None:
        self.llm.close()
