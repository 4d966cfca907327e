"""The monokernel's CUDA side: ``csrc/`` (the persistent decode kernel, one file a stage),
``layout`` (every buffer shared with the kernel, described once; generates
``csrc/layout.cuh``), ``build`` (nvcc JIT with an on-disk cache, the per-shape choices),
``launcher`` (driver-API load and cooperative launch), ``schedule`` (the kernel's stages in
PyTorch, for CPU tests), ``plan`` (stage B's plan on the host) and ``prebuild`` (parallel
builds). Standalone cubins beside it: ``prefill_allreduce`` (the TP prefill's all-reduce
between the GPUs), and the benchmarks' ``allreduce`` and ``skinny_gemv``."""
