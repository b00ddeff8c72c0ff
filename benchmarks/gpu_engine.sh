#!/usr/bin/env bash
# The engine's GPU call (issue 13), at most BUDGET=560 s (about 6-7 minutes) on an H200. From the repo root:
#   OUT=/some/dir bash benchmarks/gpu_engine.sh
#   STAGES="profile1 generate" bash benchmarks/gpu_engine.sh   # a subset (tests profile1 profile32 prefill generate gemv)
#   SMOKE=1 bash benchmarks/gpu_engine.sh                      # CPU: tiny model, checks the plumbing only
# Stages, each python step under its own `timeout`:
#   tests      pytest -m gpu tests/engine/test_engine_gpu.py (graph steps vs eager, bf16 vs the reference,
#              compile_model=True inside the graphs as the batch shrinks)
#   profile1   profile_decode_step.py at batch 1, 8K: graphs (async_decode steps, then synchronous
#              ones), graphs + Triton GEMV, torch.compile in graphs, eager profile, split sweep
#   profile32  the same at batch 32 (graphs, async and sync, and eager only: bench_generate
#              measures compile there)
#   generate   bench_generate.py --quick --modes sparse: plain graphs, +compile, +Triton GEMV
#   prefill    profile_prefill.py: TTFT of a first and a second 8K / 32K prompt, a prefill's kernels grouped
#   gemv       bench_gemv.py: each 7b linear layer, cuBLAS vs the Triton GEMV (GEMV_SWEEP=1: tiles too)
# Writes to $OUT: summary.txt, profile_b1.json, profile_b32.json, generate.json, gemv.json, logs.tar.gz;
# prints a short table last.
set -uo pipefail
OUT=${OUT:-/tmp/sparsegen-engine-out}
LOGS=$(mktemp -d /tmp/sparsegen-engine-logs.XXXX)
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export SPARSEGEN_CACHE_DIR=${SPARSEGEN_CACHE_DIR:-/tmp/sparsegen-cache}
STAGES=${STAGES:-"tests profile1 profile32 generate gemv"}
SMOKE=${SMOKE:-0}
summary=$OUT/summary.txt
: > "$summary"
trap 'tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null' EXIT

want() { [[ " $STAGES " == *" $1 "* ]]; }
# The whole call stays within BUDGET seconds (the device tool stops a command at 600 s): each
# step's timeout is cut to what is left, and a step with under 20 s left is skipped.
DEADLINE=$((SECONDS + ${BUDGET:-560}))
# step NAME SECONDS CMD...: run CMD under timeout, log to $LOGS/NAME.log, note rc and seconds.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  if ((left < 20)); then
    echo "$name skipped: ${left} s left of BUDGET" | tee -a "$summary"
    return 124
  fi
  ((limit > left)) && limit=$left
  local t0=$EPOCHREALTIME
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc in $(awk "BEGIN{printf \"%.0f\", $EPOCHREALTIME-$t0}") s (limit $limit s)" | tee -a "$summary"
  return $rc
}

if [[ $SMOKE == 1 ]]; then
  PROFILE_ARGS=(--smoke --steps 2 --context 64)
  PROFILE1_FLAGS=(--gemv)  # inductor on a CPU takes minutes; the CPU tier traces compile_model with aot_eager
  GEN_ARGS=(--smoke --compile off --gemv both --modes sparse)
  PROF32_BATCH=3
else
  PROFILE_ARGS=()
  PROFILE1_FLAGS=(--compile --gemv)
  GEN_ARGS=(--quick --compile both --gemv both --modes sparse)
  PROF32_BATCH=32
fi

{
  date -u +"date %Y-%m-%dT%H:%MZ"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='tree %h %s' 2>/dev/null | cut -c1-100
  echo "stages: $STAGES"
} >> "$summary" 2>&1
cat "$summary"

if want tests; then
  echo "== engine gpu tests"
  step tests "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu -s -p no:cacheprovider --durations=8 \
    tests/engine/test_engine_gpu.py
  grep -E '(passed|failed|error|skipped)' "$LOGS/tests.log" | tail -n 1 | tee -a "$summary"
  grep -E '^(FAILED|ERROR)|tokens/s' "$LOGS/tests.log" | head -n 12
fi

if want profile1; then
  echo "== profile: batch 1, 8K context, graphs / compile in graphs / eager"
  step profile_b1 "${PROFILE_TIMEOUT:-150}" python3 benchmarks/engine/profile_decode_step.py --batch 1 "${PROFILE1_FLAGS[@]}" \
    --json "$OUT/profile_b1.json" "${PROFILE_ARGS[@]}"
  grep -E '^(weights|step|GPU kernel|aten ops|decode |\|)' "$LOGS/profile_b1.log" | tee -a "$summary"
fi

if want profile32; then
  echo "== profile: batch $PROF32_BATCH, 8K context, graphs / eager"
  step profile_b32 "${PROFILE32_TIMEOUT:-120}" python3 benchmarks/engine/profile_decode_step.py --batch "$PROF32_BATCH" \
    --steps 4 --json "$OUT/profile_b32.json" "${PROFILE_ARGS[@]}"
  grep -E '^(weights|step|GPU kernel|aten ops|decode |\|)' "$LOGS/profile_b32.log" | tee -a "$summary"
fi

if want prefill; then
  echo "== profile: one prompt's prefill (TTFT), 8K and 32K"
  plen=8192,32768; [[ $SMOKE == 1 ]] && plen=40,70
  smoke=(); [[ $SMOKE == 1 ]] && smoke=(--smoke)
  step prefill "${PREFILL_TIMEOUT:-120}" python3 benchmarks/engine/profile_prefill.py --lengths "$plen" \
    --json "$OUT/profile_prefill.json" "${smoke[@]}"
  grep -E '^[0-9]+ tokens|^  (GEMMs|kernels span|\|)' "$LOGS/prefill.log" | tee -a "$summary"
fi

if want generate; then
  echo "== bench_generate ${GEN_ARGS[*]}"
  step generate "${GEN_TIMEOUT:-200}" python3 benchmarks/engine/bench_generate.py "${GEN_ARGS[@]}" --out "$OUT/generate.json"
  grep -E '^(sparse|dense)' "$LOGS/generate.log" | tee -a "$summary"
fi

if want gemv; then
  echo "== bench_gemv (7b linear layers at batch 1)"
  if [[ $SMOKE == 1 ]]; then
    echo "gemv skipped: needs a GPU" | tee -a "$summary"
  else
    sweep=(); [[ ${GEMV_SWEEP:-0} == 1 ]] && sweep=(--sweep)
    step gemv "${GEMV_TIMEOUT:-60}" python3 benchmarks/linear/bench_gemv.py --out "$OUT/gemv.json" "${sweep[@]}"
    grep -E '^[a-z_+]+ +N|^one layer' "$LOGS/gemv.log" | tee -a "$summary"
  fi
fi

echo
echo "================ SUMMARY ================"
cat "$summary"
python3 - "$OUT" <<'EOF' | tee -a "$summary"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])


def load(name):
    p = out / name
    try:
        return json.loads(p.read_text()) if p.exists() else None
    except ValueError:
        return None


rows = []
for name in ("profile_b1.json", "profile_b32.json"):
    r = load(name)
    if not r:
        continue
    b = r["batch"]
    for key in ("CUDA graphs", "CUDA graphs, sync steps", "CUDA graphs + Triton GEMV", "torch.compile in CUDA graphs"):
        if key in r:
            x = r[key]
            rep = x.get("replay_ms")
            rows.append((f"profile b{b} {key}", f"{x['step_ms']:.2f} ms", f"{x['tokens_per_s']:.0f} tok/s",
                         f"replay {rep:.2f} ms" if rep else "-", f"floor {r.get('floor_ms', 0):.2f} ms"))
    if "kernel_ms_per_step" in r:
        top = ", ".join(f"{k['group'].split(' (')[0]} {k['ms']:.2f}" for k in r["kernels"][:4])
        rows.append((f"profile b{b} eager kernels", f"{r['kernel_ms_per_step']:.2f} ms", top, "", ""))
    for s in r.get("split_sweep", []):
        us = {int(k): v for k, v in s["us_by_splits"].items()}
        rows.append((f"profile b{b} decode {s['kind']}", f"best {s['best']}: {us[s['best']]:.1f} us",
                     f"pick {s['pick_graph']}: {us.get(s['pick_graph'], float('nan')):.1f} us", "", ""))
g = load("generate.json")
for mode, r in (g or {}).items():
    if isinstance(r, dict) and "decode_b1" in r:
        rows.append((f"generate {mode}", f"TTFT {r['ttft_8k']['ttft_s'] * 1e3:.0f}/{r['ttft_32k']['ttft_s'] * 1e3:.0f} ms",
                     f"b1 {r['decode_b1']['tokens_per_s']:.1f} tok/s ({r['decode_b1']['step_ms']:.2f} ms)",
                     f"b{r['decode_b32']['batch']} {r['decode_b32']['tokens_per_s']:.0f} tok/s "
                     f"({r['decode_b32']['step_ms']:.2f} ms)", ""))
gm = load("gemv.json")
for r in (gm or {}).get("rows", []):
    rows.append((f"gemv {r['name']}", f"cuBLAS {r['cublas_us']:.1f} us ({r['cublas_tb_s']:.2f} TB/s)",
                 f"GEMV {r['gemv_us']:.1f} us ({r['gemv_tb_s']:.2f} TB/s)", f"err {r['rel_err']:.1e}",
                 f"best {r['best_us']:.1f} us {r['best_tile']}" if "best_us" in r else ""))
print("| what | | | | |\n|---|---|---|---|---|")
for row in rows:
    print("| " + " | ".join(row) + " |")
print("targets: b1 >= 230 tok/s (<= 4.3 ms), b32 >= 3000 tok/s (<= 10.7 ms), TTFT 8K/32K <= 190/950 ms")
EOF
