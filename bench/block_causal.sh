#!/usr/bin/env bash
# Block-causal against causal attention, in one run: the debug model (bf16,
# no activation checkpointing) at seq 2048 on Shakespeare's training works cut
# into documents of about 256 tokens (770 bytes, whole lines, one JSON Lines
# record each). Each mask trains the same batches with the op table on; the
# table gives attention's forward and backward time per step, their ratio, and
# the share of the causal tiles the kernels ran (the trainer's first-step line).
# Runs alternate (causal, block-causal, ...) because this host's speed drifts.
#
#   bench/block_causal.sh [seq_len batch doc_bytes]
#       default: 2048 2 770
# Environment: ROUNDS (2), STEPS (6; the op table averages the steps after the first),
# ANVIL (the binary, build/anvil: another build's, to compare two).
set -euo pipefail
cd "$(dirname "$0")/.."
SEQ=${1:-2048} BATCH=${2:-2} DOC_BYTES=${3:-770}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-6}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
ANVIL=${ANVIL:-build/anvil}
[ -x "$ANVIL" ] || { echo "build first: ninja -C build anvil" >&2; exit 2; }
scripts/prepare_data.sh >/dev/null
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# The works cut into documents of about DOC_BYTES bytes.
/usr/bin/python3 - "$DOC_BYTES" "$out/documents.jsonl" <<'EOF'
import glob, json, sys
size, path = int(sys.argv[1]), sys.argv[2]
with open(path, "w") as f:
    for work in sorted(glob.glob("data/shakespeare/train/*.txt")):
        doc = ""
        for line in open(work, encoding="utf-8"):
            doc += line
            if len(doc) >= size:
                f.write(json.dumps({"text": doc}) + "\n")
                doc = ""
        if doc:
            f.write(json.dumps({"text": doc}) + "\n")
EOF

run() {  # mask round -> the op table's attention seconds per step, forward and backward; the tile share
  local dump="$out/$1_$2"
  "$ANVIL" train configs/debugmodel.toml --training.dataset text --training.dataset_path "$out/documents.jsonl" \
    --training.seq_len "$SEQ" --training.local_batch_size "$BATCH" --training.steps "$STEPS" \
    --model.attn_mask_type "$1" --profiling.op_times true --profiling.enable_profiling false \
    --profiling.enable_memory_snapshot false --checkpoint.enable false --validation.enable false \
    --metrics.enable_tensorboard false --metrics.log_freq "$STEPS" --job.dump_folder "$dump" > "$dump.log" 2>&1
  /usr/bin/python3 - "$dump/op_times.json" "$dump.log" <<'EOF'
import json, re, sys
rows = json.load(open(sys.argv[1]))["ops"]
def seconds(name):  # the op's own time and its children's (the tile products it calls)
    return sum(r["seconds"] for r in rows if r["op"] == name or r["parent"] == name)
tiles = "1.000"
m = re.search(r"([0-9.]+)% of its tiles", open(sys.argv[2]).read())
if m:
    tiles = "%.3f" % (float(m.group(1)) / 100)
print("%.4f %.4f %s" % (seconds("attention.forward"), seconds("attention.backward"), tiles))
EOF
}

echo "block-causal vs causal attention: debugmodel, seq $SEQ, batch $BATCH, documents of ~$DOC_BYTES bytes, $(nproc) cores"
printf '| round | causal fwd+bwd s/step | block-causal fwd+bwd s/step | time ratio | tiles kept | ratio / tiles kept |\n'
printf '|---|---|---|---|---|---|\n'
for r in $(seq 1 "$ROUNDS"); do
  read -r cf cb _ < <(run causal "$r")
  read -r bf bb kept < <(run block_causal "$r")
  /usr/bin/python3 -c "
c, b, k = $cf + $cb, $bf + $bb, $kept
print('| %d | %.4f | %.4f | %.3f | %.3f | %.2f |' % ($r, c, b, b / c, k, b / c / k))"
done
grep -h "block-causal attention:" "$out/block_causal_1.log" | sed 's/^anvil: /block-causal run, /'
