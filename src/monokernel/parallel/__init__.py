"""Tensor parallelism's measurements: the in-kernel all-reduce against NCCL
(``allreduce_bench``) and TP=1 against TP=N decode speed (``tp_speed``). The backend and its
peer memory live in ``monokernel.runtime.backends.monokernel`` (``tp``, ``peer``), the weight
split in ``monokernel.weights.shard``; the design is in docs/tensor-parallel.md."""
