#!/usr/bin/env bash
# Seed 000 (PyTorch #159251) reproduced and fixed: DP 2 (FSDP) x PP 2 on 4
# ranks, 1F1B, micro-batches of one sequence, Llama 3's 128,256-token
# vocabulary on the debug model's blocks (llama3/debugmodel_128k), full
# activation checkpointing as in the seed. For 2, 4, 8 and 16 micro-batches per
# step: each stage's allocator peak and peak RSS, by default and with
# --parallelism.pipeline_parallel_keep_outputs (the last stage keeps every
# micro-batch's logits until the step ends, as torchtitan did before the fix).
# World ranks 0-1 hold stage 0, ranks 2-3 the last stage (pp is the outermost
# mesh dimension).
#
#   bench/pipeline_seed000.sh            Environment: SEQ (512), STEPS (2), MICRO ("2 4 8 16")
set -euo pipefail
cd "$(dirname "$0")/.."
SEQ=${SEQ:-512}
STEPS=${STEPS:-2}
MICRO=${MICRO:-"2 4 8 16"}
export OMP_NUM_THREADS=1
[ -x build/anvil ] || { echo "build first: scripts/test.sh or scripts/train.sh" >&2; exit 1; }
scripts/prepare_data.sh >/dev/null
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
mpi=(mpirun --oversubscribe -np 4)
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

printf "\n## DP 2 x PP 2, 1F1B, llama3/debugmodel_128k, seq %s, micro-batches of 1, bf16, AC full\n\n" "$SEQ"
printf "| keep outputs | micro-batches | stage 0 peak (rank 0) | last stage peak (rank 2) | stage 0 peak RSS | last stage peak RSS |\n"
printf "|---|---|---|---|---|---|\n"
for keep in false true; do
  for m in $MICRO; do
    "${mpi[@]}" build/anvil train configs/debugmodel.toml --model.flavor debugmodel_128k --training.seq_len "$SEQ" \
      --training.local_batch_size "$m" --training.global_batch_size $((2 * m)) \
      --parallelism.data_parallel_shard_degree 2 --parallelism.pipeline_parallel_degree 2 \
      --parallelism.pipeline_parallel_schedule 1F1B --parallelism.pipeline_parallel_microbatch_size 1 \
      --parallelism.pipeline_parallel_keep_outputs "$keep" --activation_checkpoint.mode full \
      --training.steps "$STEPS" --metrics.log_freq 1 --validation.enable false --checkpoint.enable false \
      --metrics.enable_tensorboard false --job.dump_folder "$out/run" > "$out/log" 2>&1 || { cat "$out/log" >&2; exit 1; }
    python3 - "$out/run/metrics.jsonl" "$keep" "$m" <<'PY'
import json, sys
last = [json.loads(l) for l in open(sys.argv[1])][-1]
peak, rss = last["peak_mib_by_rank"], last["peak_rss_mib_by_rank"]
print(f"| {sys.argv[2]} | {sys.argv[3]} | {peak[0]:.1f} MiB | {peak[2]:.1f} MiB | {rss[0]:.0f} MiB | {rss[2]:.0f} MiB |")
PY
    rm -rf "$out/run"
  done
done
