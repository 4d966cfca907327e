#!/usr/bin/env bash
# One call on the 2-GPU (NVLink) machine: the `gpu` tests of the tensor-parallel code (incl. the
# TP=2 decode kernel), a TP=1 vs TP=2 decode speed run, then the in-kernel all-reduce benchmark
# against NCCL. NVLink multicast stays off throughout.
#   scripts/tp_check.sh OUTDIR
#   MK_AR_SIZES=4096 MK_AR_ARGS="--iters 50000" scripts/tp_check.sh "$OUT"
# Logs and JSON land in OUTDIR; the test summary and the benchmark table are printed last.
set -u -o pipefail
OUTDIR=${1:?usage: scripts/tp_check.sh OUTDIR}
mkdir -p "$OUTDIR"
cd "$(dirname "$0")/.."
# Multicast (NVLS) off, for us and for anything started from here: using it can take the
# shared host's GPUs out of service. Exported, so every subprocess (NCCL ranks) inherits it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export MONOKERNEL_CACHE=${MONOKERNEL_CACHE:-/tmp/monokernel-cache}
SIZES=${MK_AR_SIZES:-2048,4096,8192,16384,32768}
status=0

{ nvidia-smi; nvidia-smi topo -m; nvcc --version
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(),
"gpus", torch.cuda.device_count(), "p2p 0<->1",
torch.cuda.device_count() > 1 and torch.cuda.can_device_access_peer(0, 1))'
  env | grep -E "NVLS|MULTICAST"; } >"$OUTDIR/env.txt" 2>&1
grep -E "^torch|NVLS|MULTICAST" "$OUTDIR/env.txt" >&2

echo "== gpu tests (tensor parallel)" >&2
timeout "${MK_TEST_TIMEOUT:-400}" python3 -m pytest -m gpu -v -s -p no:cacheprovider \
  src/monokernel/parallel src/monokernel/weights/test_shard.py >"$OUTDIR/tests.log" 2>&1 || status=1

echo "== gpu tests (TP decode kernel)" >&2
timeout "${MK_TP_TEST_TIMEOUT:-400}" python3 -m pytest -m gpu -v -s -p no:cacheprovider \
  src/monokernel/runtime/backends/test_monokernel_tp.py src/monokernel/kernels/test_tp_params.py \
  >"$OUTDIR/tp_tests.log" 2>&1 || status=1

echo "== TP=1 vs TP=2 decode speed (qwen2.5-coder-1.5b shape, 64-token prompt, 512 tokens)" >&2
timeout "${MK_SPEED_TIMEOUT:-400}" python3 -m monokernel.parallel.tp_speed --tp 2 \
  --shape qwen2.5-coder-1.5b --prompt 64 --tokens 512 >"$OUTDIR/tp_speed.log" 2>&1 || status=1

echo "== all-reduce benchmark" >&2
# shellcheck disable=SC2086  # MK_AR_ARGS is a list of flags
timeout "${MK_BENCH_TIMEOUT:-400}" python3 -m monokernel.parallel.allreduce_bench \
  --sizes "$SIZES" --json "$OUTDIR/allreduce.json" ${MK_AR_ARGS:-} \
  >"$OUTDIR/allreduce.log" 2>&1 || status=1

echo "== results" >&2
grep -E "PASSED|FAILED|ERROR|SKIPPED|rel err|µs per all-reduce|[0-9]+ (passed|failed|skipped)" \
  "$OUTDIR/tests.log" | tail -30
grep -E "PASSED|FAILED|ERROR|SKIPPED|rel L2|[0-9]+ (passed|failed|skipped)" \
  "$OUTDIR/tp_tests.log" | tail -30
grep -E "Error|error|Traceback|µs/token|speed-up" "$OUTDIR/tp_speed.log" | tail -8
grep -E "Error|error|Traceback|^needs" "$OUTDIR/allreduce.log" | tail -5
grep -E "^\||^device:|^target" "$OUTDIR/allreduce.log"
exit $status
