"""Host-side rules of a monokernel request (request.py) that need no GPU."""

from __future__ import annotations

import pytest

from monokernel.errors import InvalidRequestError
from monokernel.runtime.backends.monokernel.request import prefill_gives_first


def test_the_first_token_source_is_the_argument_else_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MONOKERNEL_FIRST_TOKEN", "kernel")
    assert not prefill_gives_first(None)
    assert prefill_gives_first("prefill")
    monkeypatch.setenv("MONOKERNEL_FIRST_TOKEN", "prefill")
    assert prefill_gives_first(None)
    assert not prefill_gives_first("kernel")
    with pytest.raises(InvalidRequestError, match="'decode'; choose from prefill, kernel"):
        prefill_gives_first("decode")
