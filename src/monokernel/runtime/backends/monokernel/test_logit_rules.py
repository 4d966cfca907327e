"""What LogitRules hands the kernel (logit_rules.py), on the CPU: the Params fields and the
buffers behind them. The kernel's use of them is test_logit_rules_kernel.py (GPU)."""

from __future__ import annotations

import pytest
import torch

from monokernel.errors import InvalidRequestError
from monokernel.runtime.backends.monokernel.logit_rules import NEUTRAL, LogitRules
from monokernel.runtime.sampling import SamplingParams


def _rules() -> LogitRules:
    return LogitRules(50, 8, torch.device("cpu"))


def test_a_request_without_them_gets_the_neutral_fields_and_no_fill() -> None:
    rules = _rules()
    assert rules.fields(SamplingParams(temperature=0.7, top_p=0.9), [1, 2], [3]) is NEUTRAL
    assert not LogitRules.filled(NEUTRAL)
    # min_p needs no buffer (and greedy ignores it).
    f = rules.fields(SamplingParams(temperature=0.7, min_p=0.2), [1], [])
    assert f["min_p"] == pytest.approx(0.2) and not LogitRules.filled(f)
    assert rules.fields(SamplingParams(temperature=0.0, min_p=0.2), [1], [])["min_p"] == 0.0


def test_seen_words_hold_the_prompt_bit_and_twice_the_output_counts() -> None:
    rules = _rules()
    f = rules.fields(SamplingParams(repetition_penalty=1.3), [4, 4, 9], [9, 7, 7])
    assert LogitRules.filled(f) and f["repetition"] == pytest.approx(1.3)
    seen = rules._seen
    assert seen is not None
    want = torch.zeros(50, dtype=torch.int32)
    want[4], want[9], want[7] = 1, 1 + 2, 4
    assert torch.equal(seen, want)
    # Without repetition_penalty the prompt does not count, and a later request starts clean.
    rules.fields(SamplingParams(frequency_penalty=0.5), [4], [7])
    want = torch.zeros(50, dtype=torch.int32)
    want[7] = 2
    assert torch.equal(seen, want)


def test_logit_bias_is_dense_and_checked_against_the_vocabulary() -> None:
    rules = _rules()
    f = rules.fields(SamplingParams(logit_bias={3: 2.5, 49: -100.0}), [1], [])
    assert LogitRules.filled(f) and f["seen"] == 0
    bias = rules._bias
    assert bias is not None and bias[3] == 2.5 and bias[49] == -100.0 and bias.abs().sum() == 102.5
    with pytest.raises(InvalidRequestError, match="past the vocabulary"):
        rules.fields(SamplingParams(logit_bias={50: 1.0}), [1], [])
