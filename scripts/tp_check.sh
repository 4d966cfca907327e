#!/usr/bin/env bash
# One call on the 2-GPU (NVLink) machine: the `gpu` tests of the tensor-parallel code (incl. the
# TP=2 decode kernel), TP=1 vs TP=2 `monokernel bench` runs, the in-kernel all-reduce benchmark
# against NCCL, then `monokernel run --tp 2` and `monokernel serve --tp 2` end to end on a
# random-weight checkpoint. NVLink multicast stays off throughout.
#   scripts/tp_check.sh OUTDIR
#   MK_AR_SIZES=4096 MK_AR_ARGS="--iters 50000" scripts/tp_check.sh "$OUT"
#   MK_TP_STAGES=cli scripts/tp_check.sh "$OUT"     # only some stages (comma-separated)
#   MK_SPEED_SHAPES="llama-3.1-8b:64,1024" ...        # the speed stage's SHAPE:PROMPTS list
# Stages: tests, tp_tests, speed, big (the 32B shape), allreduce, cli (default: all, in that
# order).
# Logs and JSON land in OUTDIR; the test summary and the benchmark table are printed last.
#
# The cli stage needs the server's Python packages (fastapi, uvicorn, pydantic, ...), which
# the GPU image lacks and cannot download: carry them as wheels in .whl/ (ignored by git; see
# docs/tensor-parallel.md), i.e. call the device tool with carry=[".whl"]. The stage installs
# them into /tmp/site; without .whl/ it still runs `run --tp`, and skips serve with a message.
# It writes a random checkpoint in the qwen2.5-coder-1.5b shape (12 heads, 2 KV heads) to /tmp:
# the machine has no network, and the real checkpoint we carry (SmolLM2, 3 KV heads) does not
# split over 2 GPUs. Knobs: MK_CLI_SHAPE, MK_CLI_TP (2), MK_CLI_PORT (8765), MK_CLI_ARGS
# (extra flags for run and serve, e.g. "--engine reference --device cpu" for a CPU dry run,
# with MK_CLI_TP=1 MK_CLI_GEN_DEVICE=cpu).
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
STAGES=${MK_TP_STAGES:-all}
status=0
want() { [[ $STAGES == all || ",$STAGES," == *",$1,"* ]]; }
for s in ${STAGES//,/ }; do
  [[ $s =~ ^(all|tests|tp_tests|speed|big|allreduce|cli)$ ]] ||
    { echo "MK_TP_STAGES: unknown stage '$s' (tests, tp_tests, speed, big, allreduce, cli)" >&2; exit 2; }
done

{ nvidia-smi; nvidia-smi topo -m; nvcc --version
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(),
"gpus", torch.cuda.device_count(), "p2p 0<->1",
torch.cuda.device_count() > 1 and torch.cuda.can_device_access_peer(0, 1))'
  env | grep -E "NVLS|MULTICAST"; } >"$OUTDIR/env.txt" 2>&1
grep -E "^torch|NVLS|MULTICAST" "$OUTDIR/env.txt" >&2

if want tests; then
  echo "== gpu tests (tensor parallel)" >&2
  MONOKERNEL_BUILD_LOG=$OUTDIR/builds.jsonl \
  timeout "${MK_TEST_TIMEOUT:-400}" python3 -m pytest -m gpu -v -s -p no:cacheprovider \
    src/monokernel/parallel src/monokernel/runtime/backends/monokernel/test_peer.py \
    src/monokernel/weights/test_shard.py >"$OUTDIR/tests.log" 2>&1 || status=1
fi

if want tp_tests; then
  echo "== gpu tests (TP decode kernel)" >&2
  MONOKERNEL_BUILD_LOG=$OUTDIR/builds.jsonl \
  timeout "${MK_TP_TEST_TIMEOUT:-400}" python3 -m pytest -m gpu -v -s -p no:cacheprovider \
    src/monokernel/runtime/backends/monokernel/test_tp.py \
    >"$OUTDIR/tp_tests.log" 2>&1 || status=1
fi

if want speed; then
  # `monokernel bench`, TP=1 and TP=2 side by side in one process per shape (64-token prompt,
  # 512 generated; Qwen also at a 2,048-token prompt for the time to first token).
  for spec in ${MK_SPEED_SHAPES:-qwen2.5-coder-1.5b:64,2048 llama-3.1-8b:64}; do
    shape=${spec%%:*} prompts=${spec#*:}
    echo "== bench $shape: monokernel vs monokernel@tp2" >&2
    timeout "${MK_SPEED_TIMEOUT:-400}" python3 -m monokernel.cli.main bench --shape "$shape" \
      --engines monokernel,monokernel@tp2 --prompt-tokens "$prompts" --gen-tokens 512 \
      --json "$OUTDIR/bench_$shape.json" >"$OUTDIR/bench_$shape.log" 2>&1 || status=1
  done
fi

if want big; then
  # The 32B shape: TP=1 and TP=2 side by side at the cells' own context, then TP=2 with a
  # 32,768-position cache (TP=1 does not fit one 80 GB GPU with it).
  shape=qwen2.5-coder-32b
  echo "== bench $shape: monokernel vs monokernel@tp2, then @tp2 with a 32k cache" >&2
  timeout "${MK_BIG_TIMEOUT:-420}" python3 -m monokernel.cli.main bench --shape "$shape" \
    --engines monokernel,monokernel@tp2 --prompt-tokens 64 --gen-tokens 512 \
    --json "$OUTDIR/bench_$shape.json" >"$OUTDIR/bench_$shape.log" 2>&1 || status=1
  timeout "${MK_BIG_TIMEOUT:-420}" python3 -m monokernel.cli.main bench --shape "$shape" \
    --engines monokernel@tp2 --prompt-tokens 64 --gen-tokens 512 --context 32768 \
    --json "$OUTDIR/bench_${shape}_32k.json" >"$OUTDIR/bench_${shape}_32k.log" 2>&1 || status=1
fi

if want allreduce; then
  echo "== all-reduce benchmark" >&2
  # shellcheck disable=SC2086  # MK_AR_ARGS is a list of flags
  timeout "${MK_BENCH_TIMEOUT:-400}" python3 -m monokernel.parallel.allreduce_bench \
    --sizes "$SIZES" --json "$OUTDIR/allreduce.json" ${MK_AR_ARGS:-} \
    >"$OUTDIR/allreduce.log" 2>&1 || status=1
fi

# ---- cli stage helpers -------------------------------------------------------------------
# Process ids whose process group is $1 (zombies left out), from /proc.
group_pids() {
  local f s rest st pg
  for f in /proc/[0-9]*/stat; do
    s=$(cat "$f" 2>/dev/null) || continue
    rest=${s##*) }  # the fields after "(comm)": state ppid pgrp ...
    read -r st _ pg _ <<<"$rest"
    [[ $pg == "$1" && $st != Z ]] && { f=${f#/proc/}; echo "${f%/stat}"; }
  done
}

# Stop the server started by cli_stage: SIGTERM to its process group (uvicorn shuts down
# gracefully, 5 s for open streams), SIGKILL to whatever is left after 20 s; then make sure
# nothing of the group remains.
stop_server() {
  local pid=$1 pgid=$2 i st
  [[ -n $pgid ]] && kill -TERM -- "-$pgid" 2>/dev/null
  kill -TERM "$pid" 2>/dev/null
  for ((i = 0; i < 40; i++)); do
    st=$(cat "/proc/$pid/stat" 2>/dev/null) || break
    st=${st##*) }
    [[ ${st%% *} == Z ]] && break
    sleep 0.5
  done
  [[ -n $pgid ]] && kill -KILL -- "-$pgid" 2>/dev/null
  kill -KILL "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  echo "server exit status: $? (143 = SIGTERM, 137 = SIGKILL)"
  if [[ -n $pgid ]]; then
    sleep 1
    local left
    left=$(group_pids "$pgid" | tr '\n' ' ')
    if [[ -n $left ]]; then
      echo "left over in the server's process group: $left; killing them"
      # shellcheck disable=SC2086
      kill -KILL $left 2>/dev/null
    else
      echo "no process of the server's group is left"
    fi
  fi
}

# `monokernel run --tp N` (vs --tp 1) and `monokernel serve --tp N` end to end.
cli_stage() {
  local shape=${MK_CLI_SHAPE:-qwen2.5-coder-1.5b} tp=${MK_CLI_TP:-2} port=${MK_CLI_PORT:-8765}
  local ckpt=${MK_CLI_CKPT:-/tmp/mk-random-ckpt} ok=0 rc
  local -a extra
  read -r -a extra <<<"${MK_CLI_ARGS:-}"
  local prompt='def fib(n):'

  echo "-- random checkpoint ($shape shape) in $ckpt" >&2
  [[ -f $ckpt/RANDOM_WEIGHTS.txt ]] && rm -rf "$ckpt"  # only a directory the tool wrote
  if ! timeout "${MK_CLI_CKPT_TIMEOUT:-90}" python3 -m monokernel.weights.random_checkpoint \
    "$ckpt" --shape "$shape" --device "${MK_CLI_GEN_DEVICE:-cuda}" >"$OUTDIR/cli_ckpt.log" 2>&1; then
    echo "could not write the random checkpoint:" >&2
    tail -20 "$OUTDIR/cli_ckpt.log" >&2
    return 1
  fi
  cat "$OUTDIR/cli_ckpt.log" >&2

  local t
  for t in "$tp" 1; do
    echo "-- monokernel run --tp $t --max-tokens 64 --json '$prompt'" >&2
    timeout "${MK_CLI_RUN_TIMEOUT:-150}" python3 -m monokernel.cli.main run --model "$ckpt" \
      --tp "$t" --max-tokens 64 --json ${extra[@]+"${extra[@]}"} "$prompt" \
      >"$OUTDIR/cli_run_tp$t.json" 2>"$OUTDIR/cli_run_tp$t.log"
    rc=$?
    echo "   exit status $rc" >&2
    if ((rc != 0)); then
      ok=1
      tail -25 "$OUTDIR/cli_run_tp$t.log" >&2
    fi
  done
  python3 - "$OUTDIR/cli_run_tp$tp.json" "$OUTDIR/cli_run_tp1.json" "$tp" <<'PY' >&2 || ok=1
import json, sys

def last_json(path):
    try:
        lines = [s for s in open(path).read().splitlines() if s.startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None

a, b, tp = last_json(sys.argv[1]), last_json(sys.argv[2]), sys.argv[3]
for name, r in ((f"TP={tp}", a), ("TP=1", b)):
    if r is None:
        print(f"   {name}: no JSON result")
        continue
    print(f"   {name}: engine {r['engine']} on {r['device']}, {len(r['token_ids'])} tokens "
          f"({r['finish_reason']}), prompt {r['prompt_tokens']} tokens, TTFT {r['ttft_ms']} ms, "
          f"{r['decode_tok_s']} tok/s, text {r['text'][:60]!r}")
if a is None or b is None:
    sys.exit(1)
x, y = a["token_ids"], b["token_ids"]
if x == y:
    print(f"   greedy TP={tp} vs TP=1: the {len(x)} token ids agree; text agrees: {a['text'] == b['text']}")
else:
    first = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    print(f"   greedy TP={tp} vs TP=1: DIFFER from token {first} (random weights can have "
          f"near-ties; reported, not a failure): {x[first:first + 4]} vs {y[first:first + 4]}")
PY

  echo "-- monokernel serve --tp $tp --port $port" >&2
  if ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "   SKIPPED serve: no .whl/ here (call with carry=[\".whl\"]; the image has no fastapi, " \
      "uvicorn, pydantic)" >&2
    return 1
  fi
  if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$OUTDIR/cli_pip.log" 2>&1; then
    echo "   SKIPPED serve: installing .whl/ failed:" >&2
    tail -5 "$OUTDIR/cli_pip.log" >&2
    return 1
  fi
  export PYTHONPATH=src:/tmp/site${PYTHONPATH#src}
  python3 -c 'import importlib.metadata as m, anyio, fastapi, pydantic, starlette, uvicorn
print("  ", *(f"{n} {m.version(n)}" for n in ("fastapi", "starlette", "pydantic", "pydantic-core",
      "uvicorn", "anyio", "h11", "typing-extensions")))' >&2 ||
    { echo "   SKIPPED serve: the server packages do not import" >&2; return 1; }

  local launcher=()
  command -v setsid >/dev/null && launcher=(setsid)
  ${launcher[@]+"${launcher[@]}"} python3 -m monokernel.cli.main serve "$ckpt" --tp "$tp" \
    --port "$port" --served-model-name random-ckpt ${extra[@]+"${extra[@]}"} \
    >"$OUTDIR/cli_serve.log" 2>&1 &
  local spid=$! pgid=""
  sleep 0.5
  if ((${#launcher[@]})); then
    pgid=$(cat "/proc/$spid/stat" 2>/dev/null) && pgid=${pgid##*) } && read -r _ _ pgid _ <<<"$pgid"
    [[ $pgid == "$spid" ]] || { echo "   (server pgid '$pgid' != pid $spid: killing by pid only)" >&2; pgid=""; }
  fi
  timeout "${MK_CLI_CLIENT_TIMEOUT:-200}" python3 - "http://127.0.0.1:$port" "$spid" \
    "${MK_CLI_READY_S:-150}" "$OUTDIR/cli_run_tp$tp.json" <<'PY' >&2 || ok=1
import json, sys, time, urllib.error, urllib.request

base, pid, ready_s, run_json = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]

def alive():
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"

def call(path, body=None, timeout=60.0):
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    with resp:
        return resp.status, resp.read()

t0 = time.monotonic()
health = None
while time.monotonic() - t0 < ready_s:
    if not alive():
        print(f"   the server exited before it was ready ({time.monotonic() - t0:.0f} s)")
        sys.exit(1)
    try:
        health, text = call("/health", timeout=5)
        if health == 200:
            break
    except (OSError, urllib.error.URLError):
        pass
    time.sleep(1)
if health != 200:
    print(f"   the server was not ready within {ready_s:.0f} s (last /health: {health})")
    sys.exit(1)
print(f"   ready after {time.monotonic() - t0:.1f} s")
status, text = call("/v1/models", timeout=10)
model = json.loads(text)["data"][0]["id"] if status == 200 else None
print(f"   GET /v1/models: {status}, model {model!r}")
failed = status != 200
params = {"model": model, "max_tokens": 64, "temperature": 0}
texts = {}

# 1. streamed completion, with usage in the last chunk
req = urllib.request.Request(
    base + "/v1/completions",
    data=json.dumps(params | {"prompt": "def fib(n):", "stream": True,
                              "stream_options": {"include_usage": True}}).encode(),
    headers={"Content-Type": "application/json"})
t = time.monotonic()
try:
    with urllib.request.urlopen(req, timeout=60) as resp:
        status, parts, usage, chunks, done, finish = resp.status, [], None, 0, False, None
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            obj = json.loads(line[6:])
            chunks += 1
            if obj.get("error"):
                print(f"   in-band error: {obj['error']}")
                failed = True
            for c in obj.get("choices") or []:
                parts.append(c.get("text") or "")
                finish = c.get("finish_reason") or finish
            usage = obj.get("usage") or usage
except urllib.error.HTTPError as e:
    status, parts, usage, chunks, done, finish = e.code, [], None, 0, False, None
    print(f"   body: {e.read()[:300]!r}")
texts["stream"] = "".join(parts)
print(f"   POST /v1/completions stream: {status}, {chunks} chunks, [DONE] {done}, finish "
      f"{finish}, text {len(texts['stream'])} chars, usage {usage}, {time.monotonic() - t:.1f} s")
failed |= status != 200 or not done or usage is None

# 2. the same, not streamed
t = time.monotonic()
status, text = call("/v1/completions", params | {"prompt": "def fib(n):"})
if status == 200:
    obj = json.loads(text)
    texts["plain"] = obj["choices"][0]["text"]
    print(f"   POST /v1/completions: {status}, finish {obj['choices'][0]['finish_reason']}, text "
          f"{len(texts['plain'])} chars, usage {obj.get('usage')}, {time.monotonic() - t:.1f} s")
else:
    print(f"   POST /v1/completions: {status}, body {text[:300]!r}")
    failed = True

# 3. chat, not streamed
content = None
t = time.monotonic()
status, text = call("/v1/chat/completions",
                    params | {"messages": [{"role": "user", "content": "Write fib in Python."}]})
if status == 200:
    obj = json.loads(text)
    content = obj["choices"][0]["message"]["content"] or ""
    print(f"   POST /v1/chat/completions: {status}, finish {obj['choices'][0]['finish_reason']}, "
          f"text {len(content)} chars, usage {obj.get('usage')}, {time.monotonic() - t:.1f} s")
else:
    print(f"   POST /v1/chat/completions: {status}, body {text[:300]!r}")
    failed = True

# 4. chat, streamed: the deltas, the finish and [DONE]
req = urllib.request.Request(
    base + "/v1/chat/completions",
    data=json.dumps(params | {"messages": [{"role": "user", "content": "Write fib in Python."}],
                              "stream": True}).encode(),
    headers={"Content-Type": "application/json"})
t = time.monotonic()
try:
    with urllib.request.urlopen(req, timeout=60) as resp:
        status, deltas, done, finish = resp.status, [], False, None
        for raw in resp:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
                break
            if line.startswith("data: "):
                obj = json.loads(line[6:])
                failed |= bool(obj.get("error"))
                for c in obj.get("choices") or []:
                    deltas.append((c.get("delta") or {}).get("content") or "")
                    finish = c.get("finish_reason") or finish
except urllib.error.HTTPError as e:
    status, deltas, done, finish = e.code, [], False, None
chat_stream = "".join(deltas)
print(f"   POST /v1/chat/completions stream: {status}, {len(deltas)} deltas, [DONE] {done}, "
      f"finish {finish}, text {len(chat_stream)} chars, {time.monotonic() - t:.1f} s; "
      f"== non-stream: {chat_stream == content if status == 200 else 'n/a'}")
failed |= status != 200 or not done or finish is None

# Greedy, same prompt: report whether streamed, non-streamed and `run` agree.
try:
    run_text = json.loads([s for s in open(run_json).read().splitlines() if s.startswith("{")][-1])["text"]
except (OSError, ValueError, IndexError):
    run_text = None
if "plain" in texts:
    print(f"   greedy text: stream == non-stream: {texts['stream'] == texts['plain']}; "
          f"== `run` (same TP): {texts['plain'] == run_text if run_text is not None else 'no run result'}")
print("   serve: " + ("FAILED" if failed else "ok"))
sys.exit(1 if failed else 0)
PY
  rc=$?
  echo "-- stopping the server" >&2
  stop_server "$spid" "$pgid" >&2
  if ((rc != 0)); then
    echo "-- server log tail ($OUTDIR/cli_serve.log)" >&2
    tail -40 "$OUTDIR/cli_serve.log" >&2
    ok=1
  fi
  return $ok
}

cli_status=skipped
if want cli; then
  echo "== CLI: monokernel run / serve --tp ${MK_CLI_TP:-2} on a random-weight checkpoint" >&2
  if cli_stage; then cli_status=ok; else cli_status="FAILED (messages above, logs cli_*)"; status=1; fi
fi

echo "== results" >&2
if want tests; then
  grep -E "PASSED|FAILED|ERROR|SKIPPED|rel err|µs per all-reduce|[0-9]+ (passed|failed|skipped)" \
    "$OUTDIR/tests.log" | tail -30
fi
if want tp_tests; then
  grep -E "PASSED|FAILED|ERROR|SKIPPED|rel L2|[0-9]+ (passed|failed|skipped)" \
    "$OUTDIR/tp_tests.log" | tail -30
fi
for f in "$OUTDIR"/bench_*.log; do
  [[ -f $f ]] || continue
  echo "-- $(basename "$f")"
  grep -E "^device|^engine|^monokernel|Error|Traceback" "$f" | tail -12
done
if want allreduce; then
  grep -E "Error|error|Traceback|^needs" "$OUTDIR/allreduce.log" | tail -5
  grep -E "^\||^device:|^target" "$OUTDIR/allreduce.log"
fi
echo "cli stage: $cli_status"
exit $status
