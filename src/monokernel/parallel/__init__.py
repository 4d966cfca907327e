"""Tensor parallelism's measurement of the in-kernel all-reduce against NCCL
(``allreduce_bench``); decode speed at TP=N is ``monokernel bench --engines
monokernel,monokernel@tp2``. The backend and its
peer memory live in ``monokernel.runtime.backends.monokernel`` (``tp``, ``peer``), the weight
split in ``monokernel.weights.shard``; the design is in docs/tensor-parallel.md."""
