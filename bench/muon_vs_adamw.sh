#!/usr/bin/env bash
# Does Muon train? The 25M model on the main job's corpus (Shakespeare's works
# and its 2048-token tokenizer, scripts/train.sh makes both), STEPS steps under
# AdamW and under Muon at three learning rates each, then a table of every
# run's last training losses and its validation loss, and `anvil report` of
# each optimizer's best run (lowest validation loss). No pass condition: it
# measures.
#
#   bench/muon_vs_adamw.sh            # 300 steps of 2 × 256 tokens, 6 runs (about 50 minutes on 2 cores)
#   STEPS=300 BATCH=8 SEQ=512 bench/muon_vs_adamw.sh   # the 25M config's batch (about 3 hours)
#   NS_F32=1 bench/muon_vs_adamw.sh   # and Muon's best learning rate again with Newton-Schulz in f32
#
# Muon runs with adjust_lr_fn = "match_rms_adamw" (Moonlight's choice: its
# update's RMS matched to AdamW's, so one learning rate means the same for
# both) and the same three learning rates as AdamW; its AdamW groups (the
# embedding, the head, the norms) take AdamW's middle one. Newton-Schulz in
# bf16, as torch.optim.Muon ships it. The runs go to outputs/muon_vs_adamw/.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-300}
BATCH=${BATCH:-2}
SEQ=${SEQ:-256}
LRS=${LRS:-"1e-3 2e-3 4e-3"}
out=outputs/muon_vs_adamw
[ -x build/anvil ] || { echo "build/anvil is missing: run scripts/train.sh (or cmake --build build) first" >&2; exit 1; }
[ -f data/tokenizers/shakespeare-2048/tokenizer.json ] || {
  echo "the main job's tokenizer is missing: run scripts/train.sh once first" >&2
  exit 1
}
mkdir -p "$out"
mid=$(echo "$LRS" | awk '{print $2}')
common=(configs/llama3_25m.toml --model.tokenizer_path data/tokenizers/shakespeare-2048/tokenizer.json
  --training.steps "$STEPS" --training.local_batch_size "$BATCH" --training.seq_len "$SEQ"
  --lr_scheduler.warmup_steps $((STEPS / 10)) --metrics.log_freq 5 --checkpoint.enable false
  --validation.enable true --validation.dataset_path data/shakespeare/validation --validation.freq "$STEPS"
  --validation.steps 20 --metrics.enable_tensorboard false)
for lr in $LRS; do
  echo "== AdamW lr $lr"
  build/anvil train "${common[@]}" --optimizer.name AdamW --optimizer.lr "$lr" --job.dump_folder "$out/adamw_$lr" \
    >"$out/adamw_$lr.log" 2>&1
  echo "== Muon lr $lr (AdamW groups at $mid)"
  build/anvil train "${common[@]}" --optimizer.name Muon --optimizer.muon_lr "$lr" \
    --optimizer.muon_adjust_lr_fn match_rms_adamw --optimizer.lr "$mid" --job.dump_folder "$out/muon_$lr" \
    >"$out/muon_$lr.log" 2>&1
done
python3 - "$out" $LRS <<'EOF'
import json, sys
out, lrs = sys.argv[1], sys.argv[2:]
print("| optimizer | lr | train loss, mean of the last 10 logged steps | validation loss | tok/s |")
print("|---|---|---|---|---|")
best = {}
for opt in ("adamw", "muon"):
    for lr in lrs:
        lines = [json.loads(l) for l in open(f"{out}/{opt}_{lr}/metrics.jsonl")]
        train = [l for l in lines if "loss" in l]
        val = [l["validation_loss"] for l in lines if "validation_loss" in l]
        last = sum(l["loss"] for l in train[-10:]) / len(train[-10:])
        tps = sum(l["tokens_per_s"] for l in train[1:]) / max(1, len(train) - 1)
        v = val[-1] if val else float("nan")
        print(f"| {'AdamW' if opt == 'adamw' else 'Muon'} | {lr} | {last:.4f} | {v:.4f} | {tps:,.0f} |")
        if opt not in best or v < best[opt][1]:
            best[opt] = (lr, v)
with open(f"{out}/best.txt", "w") as f:
    for opt, (lr, v) in best.items():
        f.write(f"{opt}_{lr}\n")
# The two best runs' curves: the training loss at every 25th step (the mean of the logged steps up to it since the last row).
curves = {}
for opt, (lr, v) in best.items():
    lines = [json.loads(l) for l in open(f"{out}/{opt}_{lr}/metrics.jsonl")]
    curves[opt] = {l["step"]: l["loss"] for l in lines if "loss" in l}
steps = sorted(set(curves["adamw"]) & set(curves["muon"]))
print()
print(f"| step | AdamW lr {best['adamw'][0]} | Muon lr {best['muon'][0]} |")
print("|---|---|---|")
rows = [s for s in steps if s % 25 == 0 or s == steps[-1]]
prev = 0
for r in rows:
    window = [s for s in steps if prev < s <= r]
    a = sum(curves["adamw"][s] for s in window) / len(window)
    m = sum(curves["muon"][s] for s in window) / len(window)
    print(f"| {r} | {a:.4f} | {m:.4f} |")
    prev = r
print(f"| validation | {best['adamw'][1]:.4f} | {best['muon'][1]:.4f} |")
EOF
if [ "${NS_F32:-0}" = 1 ]; then
  lr=$(sed -n 's/^muon_//p' "$out/best.txt")
  echo "== Muon lr $lr, Newton-Schulz in f32"
  build/anvil train "${common[@]}" --optimizer.name Muon --optimizer.muon_lr "$lr" \
    --optimizer.muon_adjust_lr_fn match_rms_adamw --optimizer.lr "$mid" --optimizer.muon_ns_dtype float32 \
    --job.dump_folder "$out/muon_${lr}_f32" >"$out/muon_${lr}_f32.log" 2>&1
  python3 - "$out/muon_$lr" "$out/muon_${lr}_f32" <<'EOF'
import json, sys
for d in sys.argv[1:]:
    lines = [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
    train = [l["loss"] for l in lines if "loss" in l]
    val = [l["validation_loss"] for l in lines if "validation_loss" in l]
    print(f"{d}: train loss, mean of the last 10 logged steps {sum(train[-10:]) / len(train[-10:]):.4f}, "
          f"validation loss {val[-1] if val else float('nan'):.4f}")
EOF
fi
while read -r run; do
  build/anvil report "$out/$run" --output "$out/$run.report.html" >/dev/null
  echo "best $run: $out/$run.report.html"
done <"$out/best.txt"
