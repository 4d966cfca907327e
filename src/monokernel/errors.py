"""The errors users see. Each message says what was wrong and what is accepted."""

from __future__ import annotations


class MonokernelError(Exception):
    """Base of every error this package raises on purpose."""


class UnsupportedModelError(MonokernelError):
    """The model's architecture or a feature of it is not supported."""


class WeightLoadError(MonokernelError):
    """A checkpoint's tensors do not match what the model config needs."""


class MissingTensorError(WeightLoadError):
    pass


class UnexpectedTensorError(WeightLoadError):
    pass


class TensorShapeError(WeightLoadError):
    pass


class ModelNotFoundError(MonokernelError):
    """The model reference names nothing we can open (path, hub id or GGUF file)."""


class InvalidRequestError(MonokernelError, ValueError):
    """A generation request has an out-of-range or inconsistent parameter."""


class BackendUnavailableError(MonokernelError):
    """The asked-for engine cannot run here (no GPU, wrong architecture, ...)."""


class EngineFailedError(MonokernelError, RuntimeError):
    """The engine can serve no more requests (a GPU kernel faulted, or stalled and would not
    stop): the process must be restarted."""
