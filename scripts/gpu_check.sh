#!/usr/bin/env bash
# One call on the GPU machine: build the kernel, run the `gpu` tests, run the benchmark.
#   scripts/gpu_check.sh OUTDIR            (stages from $MK_STAGES, default "build test bench")
#   MK_STAGES="build test" scripts/gpu_check.sh "$OUT"
# Stages: build (MK_BUILD_SHAPES, default every shape), test, bench (64-token prompt,
# MK_GEN_TOKENS generated, per MK_BENCH_SHAPES), sizes (the 4B-32B presets, MK_SIZE_SHAPES:
# 64-token prompt, 256 generated, the torch engine beside), long (decode after an
# MK_LONG_PROMPT-token prompt on MK_LONG_SHAPE, default Llama-3.2-1B), turn (an agent's
# 500-token turn on a held 16k-token conversation: prefix-reuse TTFT; MK_TURN_RUNS picks the
# shapes and settings), ttft (time to first token at 1,024 and 8,192 prompt tokens on
# MK_TTFT_SHAPE, first token from the prefill and from the kernel), turnattn (the turn's
# attention alone, split over 1..16 chunks of the cached keys and in the Triton kernel's
# block shapes:
# tools/turn_attention.py), prefill (where the GPU time of an 8k prompt and of that turn goes:
# tools/prefill_profile.py), stalls (where the decode kernel's warps wait: ncu,
# tools/stall_summary.py), spec (a verify pass's cost on the default model's shape, and the
# speculative workloads on the real default model if scripts/model_pieces.sh's pieces came),
# variants (tools/kernel_variants.py with the MK_VARIANTS list,
# ';'-separated, e.g. "a=;b=-DMK_X=1 -DMK_Y=2;c=MONOKERNEL_ATTN_GROUP_FROM=1";
# MK_VARIANT_PROMPT / MK_VARIANT_GEN tokens, MK_VARIANT_TP GPUs a variant runs on (NVLink
# multicast off), MK_VARIANT_QUANTIZE the layers' format (--quantize), MK_VARIANT_TAG names the
# output files).
# The tools themselves are described in tools/README.md.
# Logs and JSON land in OUTDIR; a short table is printed last. The test stage also writes
# OUTDIR/builds.jsonl, every kernel it built: `python -m monokernel.kernels.prebuild
# --from-log builds.jsonl` compiles them on a machine without a GPU before the next call.
set -u -o pipefail
OUTDIR=${1:?usage: scripts/gpu_check.sh OUTDIR}
mkdir -p "$OUTDIR"
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export MONOKERNEL_CACHE=${MONOKERNEL_CACHE:-/tmp/monokernel-cache}
STAGES=${MK_STAGES:-build test bench}
TEST_FILTER=${MK_TEST_FILTER:-}
BENCH_SHAPES=${MK_BENCH_SHAPES:-llama-3.2-1b qwen2.5-coder-1.5b}
GEN=${MK_GEN_TOKENS:-512}
status=0

{ nvidia-smi; nvcc --version; python3 -c 'import torch; print(torch.__version__)'; } \
  >"$OUTDIR/env.txt" 2>&1

# Packages the machine lacks, carried as wheels in .whl (gguf, for the real default model).
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# The real default model in pieces (scripts/model_pieces.sh): the first carried in the call
# before and copied to /tmp/model-pieces, the rest in .gpu/model; joined into the cache once,
# checked against the whole file's hash. The default-model GPU tests and the spec stage use it.
model=$MONOKERNEL_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf
if [[ ! -f $model ]] && compgen -G ".gpu/model/part-*" >/dev/null; then
  mkdir -p "$(dirname "$model")"
  # One path a piece name, in name order, wherever it came.
  mapfile -t pieces < <(ls /tmp/model-pieces/part-* .gpu/model/part-* 2>/dev/null |
    awk -F/ '!seen[$NF]++ {print $NF " " $0}' | sort | cut -d' ' -f2)
  cat "${pieces[@]}" >"$model.part"
  want=$(cat /tmp/model-pieces/SHA256 .gpu/model/SHA256 2>/dev/null | head -n 1)
  if [[ $(sha256sum "$model.part" | cut -d' ' -f1) == "$want" ]]; then
    mv "$model.part" "$model"
    echo "== the default model joined from ${#pieces[@]} pieces" >&2
  else
    rm -f "$model.part"
    echo "== the default model's pieces (${pieces[*]}) do not make the file SHA256 names" >&2
    status=1
  fi
fi

if [[ $STAGES == *build* ]]; then
  echo "== build" >&2
  timeout 300 python3 -m monokernel.kernels.prebuild ${MK_BUILD_SHAPES:-} >"$OUTDIR/build.log" \
    2>&1 || status=1
  grep -E "registers|spill|stack|: /" "$OUTDIR/build.log" >&2
fi

if [[ $STAGES == *test* ]]; then
  echo "== gpu tests" >&2
  # Every kernel the tests build, for `python -m monokernel.kernels.prebuild --from-log`
  # before the next call (compiled on a CPU machine, carried in MONOKERNEL_CACHE).
  MONOKERNEL_BUILD_LOG=$OUTDIR/builds.jsonl \
  timeout "${MK_TEST_TIMEOUT:-420}" python3 -m pytest -m gpu -v -s -p no:cacheprovider \
    ${TEST_FILTER:+-k "$TEST_FILTER"} src/monokernel >"$OUTDIR/tests.log" 2>&1 || status=1
  grep -E "PASSED|FAILED|ERROR|rel L2|greedy:|passed|failed" "$OUTDIR/tests.log" | tail -40 >&2
fi

if [[ $STAGES == *bench* ]]; then
  for shape in $BENCH_SHAPES; do
    echo "== bench $shape" >&2
    timeout "${MK_BENCH_TIMEOUT:-400}" python3 -m monokernel.bench --shape "$shape" \
      --engines "${MK_ENGINES:-monokernel,torch}" --prompt-tokens 64 --gen-tokens "$GEN" --profile \
      --json "$OUTDIR/bench-$shape.json" >>"$OUTDIR/bench.log" 2>&1 || status=1
  done
  grep -E "^(device:|engine|monokernel|torch|reference)|error" "$OUTDIR/bench.log" | grep -v Warning
fi
if [[ " $STAGES " == *" sizes "* ]]; then
  # The 4B-32B presets (issue 34), each in its own process with the torch engine beside it.
  for shape in ${MK_SIZE_SHAPES:-qwen3-4b qwen2.5-coder-7b mistral-7b llama-3.1-8b qwen3-8b \
    qwen2.5-coder-14b qwen3-14b qwen2.5-coder-32b}; do
    echo "== bench $shape" >&2
    timeout "${MK_SIZE_TIMEOUT:-240}" python3 -m monokernel.bench --shape "$shape" \
      --engines "${MK_ENGINES:-monokernel,torch}" --prompt-tokens 64 --gen-tokens 256 \
      --json "$OUTDIR/size-$shape.json" >"$OUTDIR/size-$shape.log" 2>&1 || status=1
    grep -E "^(engine|monokernel|torch)|rror" "$OUTDIR/size-$shape.log" | grep -v Warning
  done
fi

if [[ $STAGES == *long* ]]; then
  echo "== long-context decode" >&2
  timeout "${MK_LONG_TIMEOUT:-240}" python3 -m monokernel.bench --shape "${MK_LONG_SHAPE:-llama-3.2-1b}" \
    --engines "${MK_LONG_ENGINES:-monokernel}" --prompt-tokens "${MK_LONG_PROMPT:-32768}" --gen-tokens 128 --repeats 2 \
    --profile --json "$OUTDIR/long.json" >"$OUTDIR/long.log" 2>&1 || status=1
  grep -E "^(device:|engine|monokernel)|stage profile|error" "$OUTDIR/long.log" | grep -v Warning
fi

if [[ " $STAGES " == *" turn "* ]]; then
  echo "== agent turn on a held conversation" >&2
  # MK_TURN_RUNS: ';'-separated SHAPE:ENV runs, e.g. "llama-3.2-1b:;llama-3.2-1b:
  # MONOKERNEL_FIRST_TOKEN=kernel" (ENV: space-separated VAR=VALUE, may be empty).
  IFS=';' read -ra runs <<<"${MK_TURN_RUNS:-llama-3.2-1b:}"
  i=0
  for r in "${runs[@]}"; do
    shape=${r%%:*} vars=${r#*:} i=$((i + 1))
    echo "$shape ${vars:-(defaults)}:"
    env $vars timeout "${MK_TURN_TIMEOUT:-180}" python3 -m monokernel.bench --shape "$shape" \
      --engines monokernel --prompt-tokens 16384 --turn-tokens 500 --gen-tokens 64 \
      --repeats "${MK_TURN_REPEATS:-5}" --json "$OUTDIR/turn-$i.json" >"$OUTDIR/turn-$i.log" 2>&1 ||
      status=1
    grep -E "^(engine|monokernel)|error" "$OUTDIR/turn-$i.log" | grep -v Warning
  done
fi

if [[ $STAGES == *ttft* ]]; then
  echo "== time to first token" >&2
  for src in prefill kernel; do
    MONOKERNEL_FIRST_TOKEN=$src timeout "${MK_TTFT_TIMEOUT:-240}" python3 -m monokernel.bench \
      --shape "${MK_TTFT_SHAPE:-llama-3.2-1b}" --engines monokernel --prompt-tokens 64,1024,8192 \
      --gen-tokens 32 \
      --repeats "${MK_TTFT_REPEATS:-7}" \
      --json "$OUTDIR/ttft-$src.json" >"$OUTDIR/ttft-$src.log" 2>&1 || status=1
    echo "first token from the $src:"
    grep -E "^(device:|engine|monokernel)|error" "$OUTDIR/ttft-$src.log" | grep -v Warning
  done
fi

if [[ $STAGES == *turnattn* ]]; then
  echo "== turn attention" >&2
  timeout "${MK_TURNATTN_TIMEOUT:-120}" python3 tools/turn_attention.py \
    >"$OUTDIR/turnattn.log" 2>&1 || status=1
  cat "$OUTDIR/turnattn.log"
fi

if [[ $STAGES == *variants* ]]; then
  echo "== variants" >&2
  args=()
  IFS=';' read -ra vs <<<"${MK_VARIANTS:-base=}"
  for v in "${vs[@]}"; do args+=(--variant "$v"); done
  [[ -z ${MK_VARIANT_QUANTIZE:-} ]] || args+=(--quantize "$MK_VARIANT_QUANTIZE")
  # Multicast (NVLS) off, as scripts/tp_check.sh keeps it, for a TP run's ranks.
  [[ ${MK_VARIANT_TP:-1} == 1 ]] ||
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  timeout "${MK_VARIANTS_TIMEOUT:-300}" python3 tools/kernel_variants.py \
    --shapes "${MK_VARIANT_SHAPES:-llama-3.2-1b,qwen2.5-coder-1.5b}" "${args[@]}" \
    --tp "${MK_VARIANT_TP:-1}" \
    --rounds "${MK_VARIANT_ROUNDS:-3}" --prompt-tokens "${MK_VARIANT_PROMPT:-64}" \
    --gen-tokens "${MK_VARIANT_GEN:-512}" \
    --json "$OUTDIR/variants${MK_VARIANT_TAG:-}.json" >"$OUTDIR/variants${MK_VARIANT_TAG:-}.log" \
    2>&1 || status=1
  grep -A40 "^device:" "$OUTDIR/variants${MK_VARIANT_TAG:-}.log" ||
    tail -n 20 "$OUTDIR/variants${MK_VARIANT_TAG:-}.log"
fi

if [[ $STAGES == *spec* ]]; then
  # Issue 36: a verify pass's cost on the default model's shape (random weights, the pass build
  # of 4 positions, CTA 0's stage profile), then the speculative workloads on the real default
  # model where it is in the cache (scripts/model_pieces.sh).
  echo "== verify passes and speculative workloads" >&2
  for fmt in bf16 int4:32; do
    timeout "${MK_SPEC_TIMEOUT:-200}" python3 tools/verify_pass_cost.py smollm2-135m \
      --quantize "$fmt" --positions 4 --profile >"$OUTDIR/pass-${fmt/:/-}.log" 2>&1 || status=1
    grep -E "step [0-9.]+ µs|pass of" "$OUTDIR/pass-${fmt/:/-}.log"
  done
  if [[ -f $model ]]; then
    timeout "${MK_SPEC_TIMEOUT:-200}" python3 -m monokernel.bench \
      --workload spec-edit,spec-tool,spec-chat --engines monokernel \
      --num-speculative-tokens "${MK_SPEC_K:-3}" --repeats "${MK_SPEC_REPEATS:-2}" \
      --json "$OUTDIR/spec.json" >"$OUTDIR/spec.log" 2>&1 || status=1
    grep -E "^monokernel spec-|MISMATCH|rror" "$OUTDIR/spec.log"
  else
    echo "spec workloads skipped: no default model at $model (scripts/model_pieces.sh)"
  fi
fi

if [[ $STAGES == *stalls* ]]; then
  # Nsight Compute's sampled warp states for one decode launch (MK_STALL_SHAPE and
  # MK_STALL_ENGINES, e.g. monokernel:int4; clocks left alone), per machine instruction,
  # summarised by tools/stall_summary.py.
  shape=${MK_STALL_SHAPE:-qwen2.5-coder-1.5b}
  echo "== warp stalls ($shape)" >&2
  timeout "${MK_STALL_TIMEOUT:-240}" ncu --clock-control none -k mk_decode -c 1 \
    --section WarpStateStats --section SourceCounters -f -o "$OUTDIR/stalls" \
    python3 -m monokernel.bench --shape "$shape" --engines "${MK_STALL_ENGINES:-monokernel}" --prompt-tokens 64 \
    --gen-tokens 24 --repeats 1 >"$OUTDIR/stalls.log" 2>&1 || status=1
  ncu --import "$OUTDIR/stalls.ncu-rep" --page source --csv --print-source sass 2>>"$OUTDIR/stalls.log" |
    gzip >"$OUTDIR/stalls-src.csv.gz"
  rm -f "$OUTDIR/stalls.ncu-rep"  # 4 MB; the CSV holds what the summary reads
  python3 tools/stall_summary.py "$OUTDIR/stalls-src.csv.gz" | tee "$OUTDIR/stalls.txt" ||
    status=1
fi

if [[ $STAGES == *prefill* ]]; then
  echo "== prefill profile" >&2
  timeout "${MK_PREFILL_TIMEOUT:-240}" python3 tools/prefill_profile.py --shape llama-3.2-1b \
    >"$OUTDIR/prefill.log" 2>&1 || status=1
  grep -v Warning "$OUTDIR/prefill.log" | tail -n 40
fi
exit $status
