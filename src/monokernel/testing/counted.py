"""A test's stand-in that counts the calls to what it wraps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Counted:
    """A callable that counts its calls and passes them on to ``fn``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return self.fn(*args)
