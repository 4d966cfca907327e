#!/usr/bin/env bash
# The benchmark of docs/benchmarks.md in one call on the GPU machine (H100: at most ~9.5 minutes).
#   scripts/bench_all.sh OUTDIR
# Writes into OUTDIR: results.json (every cell), part-*.json (one per bench process),
# decode_vs_prompt.png, ttft_vs_prompt.png, decode_vs_gen.png, ratio_vs_torch.png,
# bench_all.log (progress and errors), env.txt, table.txt; prints the table last.
#
# The sweep runs as five bench processes, each under its own time limit: a cell that hangs
# or runs out of memory costs only its part, and every part's JSON is rewritten after each
# cell, so a part cut short still keeps what it finished. Inside a part, --time-budget stops
# starting new cells early enough for the last one to finish before the limit. Skipped cells
# are listed under the table. Most of the time goes to torch.compile (every torch cell
# compiles its engine for that cell's cache size) and to the 8192-token decodes. The fifth
# part times prefix reuse (issue 6): a 500-token turn added to a 16k-token conversation
# (--turn-tokens), which the monokernel engine prefills alone and torch recomputes whole.
#
# Knobs (environment): MK_SHAPE (llama-3.2-1b), MK_HF_CACHE (dynamic: HF's default
# generate; "static" makes generate compile each cell, which does not fit the limits),
# MK_PART_LIMITS ("185 105 95 95 80": seconds for the five parts, 560 in all; the first
# includes the monokernel's nvcc build, ~60-90 s, unless $MONOKERNEL_CACHE holds it). The
# limits are estimates made without a GPU; every record has cell_wall_s, the seconds its
# cell took, to recalibrate them from a run.
set -u -o pipefail
OUTDIR=${1:?usage: scripts/bench_all.sh OUTDIR}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export MONOKERNEL_CACHE=${MONOKERNEL_CACHE:-/tmp/monokernel-cache}
SHAPE=${MK_SHAPE:-llama-3.2-1b}
read -r -a LIMITS <<<"${MK_PART_LIMITS:-185 105 95 95 80}"
LOG="$OUTDIR/bench_all.log"
: >"$LOG"
status=0
start=$SECONDS

{ nvidia-smi; nvcc --version; python3 -c 'import torch, transformers;
print("torch", torch.__version__, "transformers", transformers.__version__)'; } \
  >"$OUTDIR/env.txt" 2>&1

COMMON=(--shape "$SHAPE" --hf-cache "${MK_HF_CACHE:-dynamic}"
  --limit reference:max-prompt=2048 --limit hf:max-gen=512)

# part NAME LIMIT_S RESERVE_S ARGS...: one bench process writing OUTDIR/part-NAME.json.
# No cell starts later than LIMIT_S - RESERVE_S into the part (RESERVE_S: about what a
# typical cell of that part takes), so the part ends by itself rather than being killed.
part() {
  local name=$1 limit=$2 reserve=$3
  shift 3
  echo "== $name: $* (at most ${limit}s; $((SECONDS - start))s so far)" | tee -a "$LOG" >&2
  local budget=$((limit > 2 * reserve ? limit - reserve : limit / 2))
  timeout --kill-after=5 "$limit" python3 -m monokernel.bench "${COMMON[@]}" "$@" \
    --time-budget "$budget" --json "$OUTDIR/part-$name.json" >>"$LOG" 2>&1
  local rc=$?
  if ((rc != 0)); then
    status=1
    if ((rc == 124 || rc == 137)); then
      echo "   $name hit its ${limit}s limit; its JSON keeps the cells it finished" | tee -a "$LOG" >&2
    fi
  fi
}

# 1. Prompt sweep, short prompts: every engine (hf and the reference only up to 512 tokens:
#    on the first H100 run their 1,024 and 2,048 cells crowded out monokernel's and torch's).
part prompts-short "${LIMITS[0]}" 35 --engines monokernel,torch,hf,reference \
  --prompt-tokens 128,512,1024,2048 --gen-tokens 128 --repeats 3 \
  --limit hf:max-prompt=512 --limit reference:max-prompt=512
# 2. Prompt sweep, long prompts: prefill dominates, so two repeats.
part prompts-long "${LIMITS[1]}" 45 --engines monokernel,torch,hf \
  --prompt-tokens 8192,32768 --gen-tokens 128 --repeats 2
# 3. Sustained decode from a 64-token prompt (hf's decode rate is in parts 1 and 2: eager
#    generate of 512 tokens did not fit here beside torch's compiles).
part gen "${LIMITS[2]}" 35 --engines monokernel,torch \
  --prompt-tokens 64 --gen-tokens 512,2048 --repeats 2
# 4. The longest generation, monokernel against torch.
part gen-8k "${LIMITS[3]}" 40 --engines monokernel,torch \
  --prompt-tokens 64 --gen-tokens 8192 --repeats 2 --limit torch:repeats=1
# 5. Prefix reuse: an agent's next turn, 500 new tokens on a 16,384-token conversation
#    (TTFT with the conversation already cached), monokernel against torch (no reuse).
part reuse "${LIMITS[4]:-80}" 40 --engines monokernel,torch \
  --prompt-tokens 16384 --turn-tokens 500 --gen-tokens 64 --repeats 3

echo "== merge, plot ($((SECONDS - start))s so far)" >&2
python3 -m monokernel.bench.merge "$OUTDIR/results.json" "$OUTDIR"/part-prompts-short.json \
  "$OUTDIR"/part-prompts-long.json "$OUTDIR"/part-gen.json "$OUTDIR"/part-gen-8k.json \
  "$OUTDIR"/part-reuse.json >>"$LOG" 2>&1 || status=1
if [[ -f $OUTDIR/results.json ]]; then
  python3 -m monokernel.bench.plot "$OUTDIR/results.json" --out "$OUTDIR" >>"$LOG" 2>&1 || status=1
  python3 -m monokernel.bench.table "$OUTDIR/results.json" >"$OUTDIR/table.txt" 2>>"$LOG" || status=1
fi
grep -E "error|Traceback" "$LOG" | grep -v Warning | tail -20 >&2
echo "== done in $((SECONDS - start))s; files in $OUTDIR" >&2
cat "$OUTDIR/table.txt" 2>/dev/null
exit $status
