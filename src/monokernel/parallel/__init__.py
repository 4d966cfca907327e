"""Tensor parallelism across the GPUs of one process: peer access (``peer``) and the in-kernel
all-reduce microbenchmark against NCCL (``allreduce_bench``). The weight split lives in
``monokernel.weights.shard``; the design is in docs/tensor-parallel.md."""
