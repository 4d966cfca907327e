"""The monokernel's CUDA side: ``csrc/`` (the persistent decode kernel), ``build`` (nvcc JIT
with an on-disk cache), ``launcher`` (driver-API load and cooperative launch), ``schedule``
(the kernel's stages in PyTorch, for CPU tests) and ``prebuild`` (parallel builds)."""
