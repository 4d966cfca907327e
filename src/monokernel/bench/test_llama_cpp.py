"""The ``llama.cpp`` bench peer: refused up front without its package or a GGUF model, and
timed like our engines when both are there."""

from __future__ import annotations

from pathlib import Path

import pytest

from monokernel.bench import cli
from monokernel.bench.llama_cpp import INSTALL_HINT, LlamaCppRunner, available
from monokernel.weights.default_model import GGUF_FILENAME, cache_root


@pytest.mark.parametrize("installed", [True, False])
def test_refused_before_loading(
    installed: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "llama_cpp_available", lambda: installed)
    # No --model: the shape's random weights are no file llama.cpp could read.
    assert cli.main(["--device", "cpu", "--engines", "torch", "--llama-cpp"]) == 2
    err = capsys.readouterr().err
    assert (INSTALL_HINT not in err) if installed else (INSTALL_HINT in err)
    assert ("pass --model FILE.gguf" in err) == installed


def test_the_flag_adds_the_engine_once() -> None:
    args = cli._parser().parse_args(["--engines", "torch,llama.cpp", "--llama-cpp"])
    assert cli._engines(args) == ["torch", "llama.cpp"]


@pytest.mark.slow
def test_times_the_default_model() -> None:
    """Exactly the asked-for tokens, greedy, from an empty cache every request."""
    gguf = cache_root() / "models" / GGUF_FILENAME
    if not available() or not Path(gguf).is_file():
        pytest.skip("needs llama-cpp-python and the default model in the cache")
    runner = LlamaCppRunner(str(gguf), 64, 2)
    try:
        prompt = list(range(100, 116))
        first, again = runner.run(prompt, 6), runner.run(prompt, 6)
    finally:
        runner.close()
    assert first.tokens == again.tokens == 6
    assert first.ttft_s > 0 and first.decode_s_per_token > 0
