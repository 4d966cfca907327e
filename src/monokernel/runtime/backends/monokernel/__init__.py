"""The monokernel backends: the whole decode loop in one persistent CUDA kernel.

One file a job: ``backend.py`` (``MonokernelBackend``, composing the rest), ``kernel.py``
(the kernel's builds, buffers, Params and launch, sized by kernels/layout.py),
``kv.py`` (the KV cache, its prefill and prefix reuse), ``request.py`` (one request: checks,
first token, streaming, stop and cancel), ``token_reader.py`` (the tokens the running kernel
publishes), ``handoff_placement.py`` (where the hand-off buffer lies), ``probes.py`` (debug
and profiling runs), ``tp.py`` (``MonokernelTPBackend``: one request over N GPUs) and
``peer.py`` (peer memory between those GPUs).
"""

from monokernel.runtime.backends.monokernel.backend import MonokernelBackend
from monokernel.runtime.backends.monokernel.kernel import monokernel_supported
from monokernel.runtime.backends.monokernel.request import FIRST_TOKEN_SOURCES

__all__ = ["FIRST_TOKEN_SOURCES", "MonokernelBackend", "monokernel_supported"]
