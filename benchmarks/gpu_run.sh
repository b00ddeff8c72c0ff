#!/usr/bin/env bash
# One GPU call: environment, gpu-marked tests, cold/warm compile, benchmarks; short table last.
# Run from the repo root on the GPU machine:  bash benchmarks/gpu_run.sh   (logs go to $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/sparsegen-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export SPARSEGEN_CACHE_DIR=${SPARSEGEN_CACHE_DIR:-/tmp/sparsegen-cache}
TEST_TIMEOUT=${TEST_TIMEOUT:-200}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-170}
summary=$OUT/summary.txt
: > "$summary"

{
  date -u +"date %Y-%m-%dT%H:%MZ"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "from sparsegen.jit.cache import nvrtc_version; print('nvrtc', nvrtc_version())"
} >> "$summary" 2>&1
cat "$summary"

echo "== compile: cold, then warm (cache in $SPARSEGEN_CACHE_DIR)"
rm -rf "$SPARSEGEN_CACHE_DIR"
t0=$EPOCHREALTIME
python3 -m sparsegen.cli compile --pattern phi3small --json > "$OUT/compile_cold.json" 2> "$OUT/compile.log"
rc_cold=$?
t1=$EPOCHREALTIME
python3 -m sparsegen.cli compile --pattern phi3small --json > "$OUT/compile_warm.json" 2>> "$OUT/compile.log"
rc_warm=$?
t2=$EPOCHREALTIME
python3 -c "import torch, triton" ; t3=$EPOCHREALTIME
echo "compile cold rc=$rc_cold $(awk "BEGIN{printf \"%.2f\", $t1-$t0}") s; warm rc=$rc_warm $(awk "BEGIN{printf \"%.2f\", $t2-$t1}") s; import torch+triton $(awk "BEGIN{printf \"%.2f\", $t3-$t2}") s" | tee -a "$summary"

echo "== gpu tests"
timeout "$TEST_TIMEOUT" python3 -m pytest -m gpu -q -s -p no:cacheprovider --durations=15 tests > "$OUT/gpu_tests.log" 2>&1
rc_tests=$?
tail -n 25 "$OUT/gpu_tests.log"
echo "gpu tests rc=$rc_tests: $(grep -E '(passed|failed|error)' "$OUT/gpu_tests.log" | tail -n 1)" >> "$summary"

echo "== benchmarks"
timeout "$BENCH_TIMEOUT" python3 -m sparsegen.cli bench --kind all --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -n 40
echo "bench rc=${PIPESTATUS[0]}" >> "$summary"
grep -A 40 '^== summary$' "$OUT/bench.log" >> "$summary"

echo "== end-to-end generate (7b random weights, sparse vs every layer dense)"
timeout "${GEN_TIMEOUT:-130}" python3 benchmarks/bench_generate.py --quick --out "$OUT/generate.json" 2>&1 | tee -a "$OUT/bench.log" | tail -n 8
echo "generate rc=${PIPESTATUS[0]}" >> "$summary"
grep -A 2 '^== summary (' "$OUT/bench.log" >> "$summary"
grep -E '^(sparse|dense) ' "$OUT/bench.log" >> "$summary"

echo
echo "================ SUMMARY ================"
cat "$summary"
