#!/usr/bin/env bash
# Two builds of `anvil` against each other on the same training runs — the
# check that a change costs no speed. The two run interleaved (A, B, A, B, ...)
# because this host's speed drifts by up to 3x between minutes; each ratio
# compares neighbouring runs, and the table ends with the median ratio per case.
#
#   bench/binary_ab.sh OLD_ANVIL NEW_ANVIL [flavor seq_len batch]...
#       default cases: debugmodel 256 8, 125M 1024 1 (bf16, no activation checkpointing);
#       a flavor that ends in .toml is a config file run at that seq_len and batch
#       (e.g. configs/qwen3_moe_debug.toml 256 8), its checkpoints and profiling off
# Environment: ROUNDS (4), STEPS (timed steps per run, 6).
# Build the old binary from another checkout, e.g.
#   git worktree add /tmp/anvil-old <rev> && cmake -S /tmp/anvil-old -B /tmp/anvil-old/build -G Ninja \
#     -DCMAKE_BUILD_TYPE=Release && ninja -C /tmp/anvil-old/build anvil
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n '2,14p' "$0" >&2; exit 2; }
old=$1 new=$2
shift 2
for b in "$old" "$new"; do [ -x "$b" ] || { echo "not an executable: $b" >&2; exit 2; }; done
ROUNDS=${ROUNDS:-4}
STEPS=${STEPS:-6}
export OMP_NUM_THREADS=2
scripts/prepare_data.sh >/dev/null

cases=("$@")
[ ${#cases[@]} -eq 0 ] && cases=(debugmodel 256 8 125M 1024 1)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# tokens/s over the timed steps (the first log interval holds the warm-up steps only).
# The data is named, not left to the default, so binaries of other versions
# (whose default dataset may differ) read the same tokens.
run() {  # binary flavor-or-config seq batch
  local model=(--model.flavor "$2")
  [[ $2 == *.toml ]] && model=("$2" --checkpoint.enable false --profiling.enable_profiling false)
  "$1" train "${model[@]}" --training.seq_len "$3" --training.local_batch_size "$4" \
    --training.mixed_precision_param bfloat16 --activation_checkpoint.mode none \
    --training.steps $((STEPS + 2)) --metrics.log_freq 2 --lr_scheduler.warmup_steps 1 \
    --validation.enable false --training.dataset text --training.dataset_path data/shakespeare/train \
    --job.dump_folder "$out/run" > "$out/log" 2>&1 || { cat "$out/log" >&2; exit 1; }
  python3 - "$out/run/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]
print(f"{sum(r['tokens_per_s'] for r in rows) / len(rows):.1f}")
PY
  rm -rf "$out/run"
}

printf "\n## %s (A) vs %s (B), bf16, %d rounds interleaved, %d timed steps per run\n\n" "$old" "$new" "$ROUNDS" "$STEPS"
printf "| model | seq | batch | round | A tok/s | B tok/s | B / A |\n|---|---|---|---|---|---|---|\n"
summary=""
i=0
while [ $i -lt ${#cases[@]} ]; do
  flavor=${cases[$i]} seq=${cases[$((i+1))]} batch=${cases[$((i+2))]}
  i=$((i+3))
  ratios=()
  for r in $(seq 1 "$ROUNDS"); do
    # Alternate which binary goes first, so neither always gets the warmer (or cooler) slot.
    if [ $((r % 2)) -eq 1 ]; then a=$(run "$old" "$flavor" "$seq" "$batch"); b=$(run "$new" "$flavor" "$seq" "$batch")
    else b=$(run "$new" "$flavor" "$seq" "$batch"); a=$(run "$old" "$flavor" "$seq" "$batch"); fi
    ratio=$(python3 -c "print(f'{$b / $a:.3f}')")
    ratios+=("$ratio")
    printf "| %s | %s | %s | %d | %s | %s | %s |\n" "$flavor" "$seq" "$batch" "$r" "$a" "$b" "$ratio"
  done
  median=$(printf "%s\n" "${ratios[@]}" | python3 -c "import sys, statistics; print(f'{statistics.median(float(x) for x in sys.stdin):.3f}')")
  summary+="| $flavor | $seq | $batch | $median |"$'\n'
done
printf "\n| model | seq | batch | median B / A |\n|---|---|---|---|\n%s" "$summary"
