"""`monokernel run` on the monokernel with the real default model: speculative decoding is
on without being asked for (K = 3, the monokernel's n-gram bounds), gives the tokens of
`--speculative off`, and drafts where the output repeats its prompt.

GPU tests (marker ``gpu``): a Hopper GPU and the default model (cached, or fetchable).
"""

from __future__ import annotations

import json

import pytest

from monokernel.cli.main import main
from monokernel.testing.gpu_models import default_model_file, needs_hopper


@pytest.mark.gpu
@needs_hopper
def test_run_drafts_by_default_with_the_tokens_of_speculative_off(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = default_model_file()
    code = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(8))
    prompt = f"Repeat this code exactly:\n\n{code}"
    argv = ["run", "--model", str(path), "--engine", "monokernel", "--max-tokens", "160"]
    argv += ["--temperature", "0", "--json", "--chat"]
    assert main([*argv, prompt]) == 0
    default = json.loads(capsys.readouterr().out)
    assert main([*argv, "--speculative", "off", prompt]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "drafted_tokens" not in plain
    assert default["token_ids"] == plain["token_ids"]
    assert default["drafted_tokens"] >= default["accepted_tokens"] > 0
