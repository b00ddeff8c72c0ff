#!/usr/bin/env bash
# One GPU call: environment, cold/warm compile, gpu-marked tests, fuzz, benchmarks, the generate
# CLI and the end-to-end generate benchmark; a short table last. From the repo root on the GPU:
#   bash benchmarks/gpu_run.sh                      # every stage but `tune`
#   STAGES="tune cli" bash benchmarks/gpu_run.sh    # just these stages (also: tune-decode, profile,
#                                                   # compare: BASE=<exported tree> [PREV=<tree>],
#                                                   # ab: the engine's prefill and b32 decode A/Bs)
# Logs: $OUT/logs.tar.gz (one file per stage), plus $OUT/summary.txt, bench.json, generate.json.
set -uo pipefail
OUT=${OUT:-/tmp/sparsegen-gpu-out}
LOGS=$(mktemp -d /tmp/sparsegen-logs.XXXX)
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export SPARSEGEN_CACHE_DIR=${SPARSEGEN_CACHE_DIR:-/tmp/sparsegen-cache}
STAGES=${STAGES:-"compile tests fuzz bench cli generate"}
summary=$OUT/summary.txt
: > "$summary"
trap 'tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null' EXIT

want() { [[ " $STAGES " == *" $1 "* ]]; }
secs() { awk "BEGIN{printf \"%.1f\", $2-$1}"; }

{
  date -u +"date %Y-%m-%dT%H:%MZ"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "from sparsegen.jit.cache import nvrtc_version; print('nvrtc', nvrtc_version())"
  echo "stages: $STAGES"
} >> "$summary" 2>&1
cat "$summary"

if want compile; then
  echo "== compile: cold, then warm (cache in $SPARSEGEN_CACHE_DIR)"
  rm -rf "$SPARSEGEN_CACHE_DIR"
  t0=$EPOCHREALTIME
  python3 -m sparsegen.cli compile --pattern phi3small --json > "$LOGS/compile_cold.json" 2> "$LOGS/compile.log"
  rc_cold=$?
  t1=$EPOCHREALTIME
  python3 -m sparsegen.cli compile --pattern phi3small --json > "$LOGS/compile_warm.json" 2>> "$LOGS/compile.log"
  rc_warm=$?
  t2=$EPOCHREALTIME
  python3 -c "import torch, triton"
  t3=$EPOCHREALTIME
  python3 -c "import torch, triton; torch.cuda.init()"
  t4=$EPOCHREALTIME
  echo "compile cold rc=$rc_cold $(secs $t0 $t1) s; warm rc=$rc_warm $(secs $t1 $t2) s;" \
    "import torch+triton $(secs $t2 $t3) s; the same + CUDA init $(secs $t3 $t4) s" | tee -a "$summary"
  tail -n 1 "$LOGS/compile.log" >> "$summary"
fi

if want tune; then
  echo "== prefill template variants"
  timeout "${TUNE_TIMEOUT:-240}" python3 benchmarks/prefill/tune_prefill.py --out "$LOGS/tune_prefill.json" \
    > "$LOGS/tune_prefill.log" 2>&1
  echo "tune rc=$?" >> "$summary"
  sed -n '/^== summary/,$p' "$LOGS/tune_prefill.log" | tee -a "$summary"
fi

if want tune-decode; then
  echo "== decode split sweep (default build)"
  timeout "${TUNE_TIMEOUT:-240}" python3 benchmarks/decode/tune_decode.py --variants default \
    --out "$LOGS/tune_decode.json" > "$LOGS/tune_decode.log" 2>&1
  echo "tune-decode rc=$?" >> "$summary"
  grep -E '^[0-9]+x[0-9]+ ' "$LOGS/tune_decode.log" | tee -a "$summary"
fi

if want profile; then
  echo "== one batch-1 decode step of 7b, profiled"
  timeout "${PROFILE_TIMEOUT:-150}" python3 benchmarks/engine/profile_decode_step.py > "$LOGS/profile_decode.log" 2>&1
  echo "profile rc=$?" >> "$summary"
  grep -E '^(weights|step|GPU kernel)' "$LOGS/profile_decode.log" | tee -a "$summary"
  grep -v '^USDT' "$LOGS/profile_decode.log" | sed -n '/^---/,$p' | head -n 30
fi

if want compare; then
  # Issue 9's bar: this tree against an exported older tree (BASE, default .gpu/base: carry it),
  # both on the tl prefill kernel; then (PREV set) against PREV with each tree's default variant.
  echo "== compare_commits against ${BASE:-.gpu/base}"
  timeout "${COMPARE_TIMEOUT:-300}" python3 benchmarks/tools/compare_commits.py --base "${BASE:-.gpu/base}" --tl \
    --rounds "${COMPARE_ROUNDS:-3}" --out "$OUT/compare_tl.json" > "$LOGS/compare_tl.log" 2>&1
  rc=$?
  echo "compare (tl, base $(cat "${BASE:-.gpu/base}/COMMIT" 2>/dev/null)) rc=$rc" >> "$summary"
  grep -vE '^round ' "$LOGS/compare_tl.log" | tail -n 22 | tee -a "$summary"
  if [[ -n "${PREV:-}" ]]; then
    timeout "${COMPARE_TIMEOUT:-300}" python3 benchmarks/tools/compare_commits.py --base "$PREV" \
      --rounds "${PREV_ROUNDS:-2}" --out "$OUT/compare_prev.json" > "$LOGS/compare_prev.log" 2>&1
    rc=$?
    echo "compare (default variants, base $(cat "$PREV/COMMIT" 2>/dev/null)) rc=$rc" >> "$summary"
    grep -vE '^round ' "$LOGS/compare_prev.log" | tail -n 22 | tee -a "$summary"
  fi
fi

if want compare-engine; then
  # The 7b engine (bench_generate --quick, sparse layers) in this tree and in BASE, one process
  # each, alternating: TTFT 8K / 32K and decode tokens/s at batch 1 and 32.
  base=${BASE:-.gpu/base}
  for round in $(seq "${ENGINE_ROUNDS:-2}"); do
    for tree in "$PWD" "$(cd "$base" && pwd)"; do
      script=$tree/benchmarks/engine/bench_generate.py
      [[ -f $script ]] || script=$tree/benchmarks/bench_generate.py
      tag=$([[ $tree == "$PWD" ]] && echo new || echo base)
      (cd "$tree" && PYTHONPATH=$PWD timeout "${ENGINE_TIMEOUT:-200}" python3 "$script" --quick --modes sparse \
        --out "$OUT/generate_${tag}_$round.json") > "$LOGS/generate_${tag}_$round.log" 2>&1
      echo "engine $tag round $round rc=$?" >> "$summary"
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], json.dumps(d)[:600])" \
        "$OUT/generate_${tag}_$round.json" "$tag" >> "$summary" 2>&1
    done
  done
fi

if want ab; then
  # One process each: the last layer on every row against the sampled rows only (TTFT), and the
  # b32 decode step before / after the output projection went through gemm_rows.
  echo "== engine A/Bs (ab_prefill.py, ab_decode_step.py --batch 32)"
  (cd benchmarks/engine && timeout "${AB_TIMEOUT:-240}" python3 ab_prefill.py --lengths 8192,32768 \
    --modes "${AB_PREFILL_MODES:-whole_last,default}" --rounds 2 --prompts 2 --json "$OUT/ab_prefill.json") \
    > "$LOGS/ab_prefill.log" 2>&1
  echo "ab_prefill rc=$?" >> "$summary"
  grep -E 'TTFT' "$LOGS/ab_prefill.log" | tee -a "$summary"
  (cd benchmarks/engine && timeout "${AB_TIMEOUT:-240}" python3 ab_decode_step.py --batch 32 \
    --modes "${AB_DECODE_MODES:-rows_qkv,defaults}" --rounds 2 --json "$OUT/ab_decode.json") \
    > "$LOGS/ab_decode.log" 2>&1
  echo "ab_decode_step rc=$?" >> "$summary"
  grep -E '^b[0-9]+ round' "$LOGS/ab_decode.log" | tee -a "$summary"
fi

if want tests; then
  echo "== gpu tests"
  # PYTEST_ARGS: e.g. "-n 3 --dist loadfile" (pytest-xdist) to spread the files over workers.
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -m gpu -q -s -p no:cacheprovider --durations=15 ${PYTEST_ARGS:-} \
    ${TESTS:-tests} > "$LOGS/gpu_tests.log" 2>&1
  rc=$?
  tail -n 25 "$LOGS/gpu_tests.log"
  echo "gpu tests rc=$rc: $(grep -E '(passed|failed|error)' "$LOGS/gpu_tests.log" | tail -n 1)" >> "$summary"
fi

if want fuzz; then
  echo "== sparsegen fuzz (random specs, prefill and decode)"
  t0=$EPOCHREALTIME
  timeout "${FUZZ_TIMEOUT:-200}" python3 -m sparsegen.cli fuzz --random --specs "${FUZZ_SPECS:-24}" \
    --examples "${FUZZ_EXAMPLES:-12}" --seed "${FUZZ_SEED:-2026}" > "$LOGS/fuzz.log" 2>&1
  rc=$?
  grep -E '^(FAIL|prefill:|decode:)' "$LOGS/fuzz.log" | head -n 20
  { echo "fuzz rc=$rc in $(secs $t0 $EPOCHREALTIME) s"; grep -E '^(prefill|decode):' "$LOGS/fuzz.log"; } >> "$summary"
fi

if want bench; then
  echo "== benchmarks"
  timeout "${BENCH_TIMEOUT:-170}" python3 -m sparsegen.cli bench --kind all --out "$OUT/bench.json" \
    > "$LOGS/bench.log" 2>&1
  echo "bench rc=$?" >> "$summary"
  grep -A 40 '^== summary$' "$LOGS/bench.log" | tee -a "$summary"
fi

if want cli; then
  echo "== sparsegen generate --random 7b (CLI: streamed text, 8K prompt; then --json)"
  python3 -c "import random; r = random.Random(0); print(''.join(r.choice('abcdefgh ') for _ in range(8192)))" \
    > "$LOGS/prompt8k.txt"
  for mode in "" "--force-dense"; do
    timeout "${CLI_TIMEOUT:-120}" python3 -m sparsegen.cli generate --random 7b --prompts-file "$LOGS/prompt8k.txt" \
      --max-tokens 64 --ignore-eos --seed 0 --temperature 0.8 $mode > "$LOGS/cli_stream${mode}.log" 2>&1
    echo "generate --stream $mode rc=$?: $(tail -n 1 "$LOGS/cli_stream${mode}.log")" | tee -a "$summary"
  done
  timeout "${CLI_TIMEOUT:-120}" python3 -m sparsegen.cli generate --random 7b --prompt-ids 1,2,3 \
    --prompt "hello" --max-tokens 32 --json > "$LOGS/cli_json.log" 2>&1
  echo "generate --json rc=$?: $(grep -c '^{' "$LOGS/cli_json.log") JSON lines" | tee -a "$summary"
  head -c 600 "$LOGS/cli_json.log"; echo
fi

if want generate; then
  echo "== end-to-end generate (7b random weights, sparse vs every layer dense)"
  timeout "${GEN_TIMEOUT:-130}" python3 benchmarks/engine/bench_generate.py --quick --out "$OUT/generate.json" \
    > "$LOGS/generate.log" 2>&1
  echo "generate rc=$?" >> "$summary"
  tail -n 8 "$LOGS/generate.log"
  grep -A 2 '^== summary (' "$LOGS/generate.log" >> "$summary"
  grep -E '^(sparse|dense) ' "$LOGS/generate.log" >> "$summary"
fi

echo
echo "================ SUMMARY ================"
cat "$summary"
