#!/usr/bin/env bash
# Training and decoding speed on an idle machine and beside one busy process
# (a shell spinning on one core), with the default thread count (no
# OMP_NUM_THREADS: Anvil sizes its threads to the cores it finds free) and with
# 1 and 2 threads pinned. Rounds interleave the cases, so drift hits all alike.
# Prints a Markdown table of medians.
#   bench/threads_busy.sh [ROUNDS]   (default 3; needs build/anvil)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
out=$(mktemp -d)
trap 'kill "$busy" 2>/dev/null || true; rm -rf "$out"' EXIT
busy=
for i in $(seq 400); do echo "Line $i: the cat sat on the mat and looked at the door of the old mill."; done > "$out/text.txt"

train() {  # threads ("" for the default) -> tokens/s over steps 3-12
  local env=()
  [ -n "$1" ] && env=(OMP_NUM_THREADS="$1")
  rm -rf "$out/run"
  env "${env[@]}" build/anvil train --training.dataset text --training.dataset_path "$out/text.txt" \
    --training.seq_len 128 --training.local_batch_size 4 --training.steps 12 --metrics.log_freq 1 \
    --metrics.enable_tensorboard false --checkpoint.enable true --checkpoint.interval 12 \
    --job.dump_folder "$out/run" > "$out/train.log" 2>&1
  python3 - "$out/run/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l][2:]
print(f"{sum(r['tokens_per_s'] for r in rows) / len(rows):.0f}")
PY
}

decode() {  # threads -> decoding tokens/s of the checkpoint train() left
  local env=()
  [ -n "$1" ] && env=(OMP_NUM_THREADS="$1")
  env "${env[@]}" build/anvil generate "$out/run/checkpoint" --prompt "The cat" --max_new_tokens 256 \
    --temperature 0 2>&1 >/dev/null | sed -n 's/.*decoding (\([0-9.]*\) tokens\/s.*/\1/p'
}

median() { sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }

declare -A tr de
for load in idle busy; do
  if [ "$load" = busy ]; then sh -c 'while :; do :; done' & busy=$!; sleep 1; fi
  for r in $(seq "$rounds"); do
    for t in default 1 2; do
      th=$t; [ "$t" = default ] && th=
      tr[$load,$t]+="$(train "$th") "
      de[$load,$t]+="$(decode "$th") "
      [ "$t" = default ] && [ "$r" = 1 ] && { grep -h "OpenMP thread" "$out/train.log" || echo "(default: no change of thread count)"; } >&2
    done
  done
  [ -n "$busy" ] && { kill "$busy"; wait "$busy" 2>/dev/null || true; busy=; }
done

echo "| machine | threads | train tok/s | decode tok/s | train rounds | decode rounds |"
echo "|---|---|---|---|---|---|"
for load in idle busy; do
  for t in default 1 2; do
    echo "| $load | $t | $(tr ' ' '\n' <<<"${tr[$load,$t]}" | grep . | median) | $(tr ' ' '\n' <<<"${de[$load,$t]}" | grep . | median) | ${tr[$load,$t]}| ${de[$load,$t]}|"
  done
done
