#!/usr/bin/env bash
# Whole training steps against the machine's own GEMM, in one run: for each
# case, a 4096 x 2048 x 2048 GEMM through Anvil's matmul (linear_forward, in
# the case's dtype) is timed right before and right after the training run,
# and the step's TFLOP/s (torchtitan's FLOPs per token x tokens/s, over the
# timed steps) is divided by their mean. The host's speed drifts by up to 3x
# between minutes, so only these neighbouring ratios count.
#
#   bench/step_vs_gemm.sh [flavor seq_len batch dtype]...
#       dtype: bf16 or fp32. Default cases: debugmodel 512 4, 25M 1024 1 and 4,
#       125M 1024 1 and 4, each in bf16 and fp32.
# Environment: STEPS (timed steps per run, 4; one more runs first as warm-up);
# OPS=1 also prints each run's per-op time table ([profiling] op_times);
# ANVIL_BF16_PRODUCTS=native|widened overrides how bf16 products run (matmul.h).
# Prints the CPU, the oneDNN kernels and a markdown table.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-4}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
[ -x build/anvil ] && [ -x build/anvil_bench ] || { echo "build first: ninja -C build anvil anvil_bench" >&2; exit 2; }
scripts/prepare_data.sh >/dev/null

cases=("$@")
if [ ${#cases[@]} -eq 0 ]; then
  for dt in bf16 fp32; do
    cases+=(debugmodel 512 4 $dt 25M 1024 1 $dt 25M 1024 4 $dt 125M 1024 1 $dt 125M 1024 4 $dt)
  done
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

gemm() {  # dtype -> TFLOP/s of the 4096 x 2048 x 2048 linear_forward
  local name=bf16
  [ "$1" = fp32 ] && name=f32
  build/anvil_bench --benchmark_filter="BM_Linear/${name}_forward/K:2048/N:2048/" 2>/dev/null |
    sed -n 's/.* TFLOP\/s=\([0-9.e+-]*\).*/\1/p' | head -1
}

step() {  # flavor seq batch dtype -> TFLOP/s over the timed steps
  local precision=bfloat16
  [ "$4" = fp32 ] && precision=float32
  rm -rf "$out/run"
  build/anvil train --model.flavor "$1" --training.seq_len "$2" --training.local_batch_size "$3" \
    --training.mixed_precision_param $precision --training.steps $((STEPS + 1)) --metrics.log_freq 1 \
    --checkpoint.enable false --profiling.enable_profiling false --profiling.enable_memory_snapshot false \
    --metrics.enable_tensorboard false --profiling.op_times true --job.dump_folder "$out/run" >/dev/null
  cp "$out/run/op_times.md" "$out/ops.$1.$2.$3.$4.md"
  # The mean of the timed steps' TFLOP/s (step 1, the warm-up, left out).
  python3 -c '
import json, sys
rates = [json.loads(l)["tflops"] for l in open(sys.argv[1]) if "\"loss\"" in l][1:]
print(sum(rates) / len(rates))' "$out/run/metrics.jsonl"
}

echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
build/anvil info | grep -E 'kernel|threads'
echo
echo "| model | seq | batch | dtype | GEMM before | step | GEMM after | step / GEMM |"
echo "|---|---|---|---|---|---|---|---|"
i=0
while [ $i -lt ${#cases[@]} ]; do
  flavor=${cases[$i]} seq=${cases[$((i + 1))]} batch=${cases[$((i + 2))]} dt=${cases[$((i + 3))]}
  i=$((i + 4))
  before=$(gemm "$dt")
  rate=$(step "$flavor" "$seq" "$batch" "$dt")
  after=$(gemm "$dt")
  python3 -c '
import sys
f, s, b, dt, g0, r, g1 = sys.argv[1:]
g0, r, g1 = float(g0), float(r), float(g1)
print(f"| {f} | {s} | {b} | {dt} | {g0:.3f} | {r:.3f} | {g1:.3f} | {r / ((g0 + g1) / 2):.2f} |")' \
    "$flavor" "$seq" "$batch" "$dt" "$before" "$rate" "$after"
done
if [ "${OPS:-0}" = 1 ]; then
  for f in "$out"/ops.*.md; do
    echo
    echo "per-op time, $(basename "$f" .md | sed 's/^ops\.//; s/\./ /g') (flavor seq batch dtype):"
    cat "$f"
  done
fi
echo
echo "TFLOP/s; GEMM: Anvil's linear_forward of 4096 x 2048 by 2048 x 2048 in the case's dtype; step: the"
echo "mean of $STEPS timed steps' TFLOP/s (torchtitan's FLOPs per token), after one warm-up step."
