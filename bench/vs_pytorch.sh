#!/usr/bin/env bash
# Anvil against the PyTorch reference (scripts/torch_llama.py, Debian's torch)
# training the same model on the same tokens, 2 threads each: Shakespeare's
# train works (data/shakespeare/train) as Anvil's text dataset reads them with
# the byte tokenizer, a stream scripts/torch_llama.py rebuilds in Python. Both
# sides are given the folder, so they read the same text whatever the defaults.
# The two sides run interleaved, round by round, because this host's speed
# drifts by up to 3x between minutes; each ratio compares neighbouring runs.
# A 2048^3 bf16 GEMM is timed in every round too.
#
#   bench/vs_pytorch.sh [flavor seq_len batch]...     default: debugmodel 256 8, 125M 1024 1
# Environment: ROUNDS (3), STEPS (timed steps per run, 6).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-6}
DATA=data/shakespeare/train  # scripts/prepare_data.sh writes it
export OMP_NUM_THREADS=2
[ -x build/anvil ] && [ -x build/anvil_bench ] || { echo "build first: scripts/test.sh or scripts/train.sh" >&2; exit 1; }
scripts/prepare_data.sh >/dev/null

cases=("$@")
[ ${#cases[@]} -eq 0 ] && cases=(debugmodel 256 8 125M 1024 1)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# Anvil: tokens/s of the timed steps (the first log interval covers warm-up steps only).
anvil_run() {  # flavor seq batch dtype ac
  local dtype=bfloat16; [ "$4" = fp32 ] && dtype=float32
  local mode=$5 opt=op
  case $5 in layer) mode=selective; opt=2 ;; op) mode=selective; opt=op ;; esac
  build/anvil train --model.flavor "$1" --training.seq_len "$2" --training.local_batch_size "$3" \
    --training.mixed_precision_param $dtype --activation_checkpoint.mode $mode \
    --activation_checkpoint.selective_ac_option $opt --training.steps $((STEPS + 2)) --metrics.log_freq 2 \
    --lr_scheduler.warmup_steps 1 --validation.enable false --training.dataset text --training.dataset_path "$DATA" \
    --job.dump_folder "$out/run" > "$out/anvil.log" 2>&1
  # The last log line covers steps STEPS+1..STEPS+2 only; use all lines after the first.
  python3 - "$out/run/metrics.jsonl" "$out/anvil.log" <<'PY'
import json, re, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]
tok = sum(r["tokens_per_s"] for r in rows) / len(rows)
mfu = sum(r["mfu_pct"] for r in rows) / len(rows)
rss = re.search(r"peak RSS ([0-9.]+ [KMG]iB)", open(sys.argv[2]).read()).group(1)
print(f"{tok:.1f} {mfu:.2f} {rows[-1]['max_active_bytes']} {rss.replace(' ', '')}")
PY
  rm -rf "$out/run"
}

torch_run() {  # flavor seq batch dtype
  OPENBLAS_CORETYPE=SkylakeX /usr/bin/python3 scripts/torch_llama.py --bench --flavor "$1" --seq-len "$2" \
    --batch "$3" --dtype "$4" --steps "$STEPS" --warmup 2 --threads 2 --data "$DATA"
}

gemm_tflops() {
  build/anvil_bench --benchmark_filter='^$' 2>/dev/null | sed -n 's/.*bf16 GEMM 2048^3 \([0-9.]*\) TFLOP.*/\1/p'
}

printf "\n## Anvil vs PyTorch %s (2 threads each, %d rounds, interleaved)\n\n" \
  "$(/usr/bin/python3 -c 'import torch; print(torch.__version__)')" "$ROUNDS"
printf "| model | seq | batch | dtype | round | GEMM TFLOP/s | Anvil tok/s | Anvil MFU | Anvil step TFLOP/s vs GEMM | PyTorch tok/s | ratio | Anvil peak RSS | PyTorch peak RSS |\n"
printf "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
i=0
while [ $i -lt ${#cases[@]} ]; do
  flavor=${cases[$i]} seq=${cases[$((i+1))]} batch=${cases[$((i+2))]}
  i=$((i+3))
  fpt=$(build/anvil estimate --model.flavor "$flavor" --training.seq_len "$seq" --json |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["flops_per_token"])')
  for dtype in bf16 fp32; do
    for r in $(seq 1 "$ROUNDS"); do
      g=$(gemm_tflops)
      read -r a_tok a_mfu _ a_rss <<<"$(anvil_run "$flavor" "$seq" "$batch" $dtype none)"
      t_json=$(torch_run "$flavor" "$seq" "$batch" $dtype)
      t_tok=$(echo "$t_json" | python3 -c 'import json,sys; print("%.1f" % json.load(sys.stdin)["tokens_per_s"])')
      t_rss=$(echo "$t_json" | python3 -c 'import json,sys; print("%.0fMiB" % (json.load(sys.stdin)["peak_rss_bytes"]/2**20))')
      python3 - "$flavor" "$seq" "$batch" $dtype "$r" "$g" "$a_tok" "$a_mfu" "$fpt" "$t_tok" "$a_rss" "$t_rss" <<'PY'
import sys
f, s, b, d, r, g, at, am, fpt, tt, ar, tr = sys.argv[1:]
step_tflops = float(at) * float(fpt) / 1e12
print(f"| {f} | {s} | {b} | {d} | {r} | {float(g):.3f} | {float(at):.0f} | {float(am):.1f}% | {step_tflops / float(g):.2f} | "
      f"{float(tt):.0f} | {float(at) / float(tt):.2f}x | {ar} | {tr} |")
PY
    done
  done
done

# Activation checkpointing, as seed 001's table: tokens/s, MFU and peak memory per mode.
printf "\n## Activation checkpointing (Anvil, bf16)\n\n| model | seq | batch | AC | tok/s | MFU | peak tracked memory | peak RSS |\n|---|---|---|---|---|---|---|---|\n"
i=0
while [ $i -lt ${#cases[@]} ]; do
  flavor=${cases[$i]} seq=${cases[$((i+1))]} batch=${cases[$((i+2))]}
  i=$((i+3))
  for ac in none layer op full; do
    read -r a_tok a_mfu a_peak a_rss <<<"$(anvil_run "$flavor" "$seq" "$batch" bf16 $ac)"
    label=$ac; [ $ac = layer ] && label="selective layer (every 2nd)"; [ $ac = op ] && label="selective op"
    printf "| %s | %s | %s | %s | %.0f | %.1f%% | %.1f MiB | %s |\n" "$flavor" "$seq" "$batch" "$label" "$a_tok" "$a_mfu" \
      "$(python3 -c "print($a_peak/2**20)")" "$a_rss"
  done
done
