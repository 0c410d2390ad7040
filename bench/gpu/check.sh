#!/usr/bin/env bash
# The GPU check: what can be checked on the GPU machine today, in one run,
# each step under its own timeout, every table printed (and kept in $OUT when
# the device tool sets it). Made here by bench/gpu/pack.sh; run there from the
# repository's root:
#
#   bench/gpu/check.sh [.gpu/anvil-gpu.tar.xz]
#
# 1. the machine: GPU, driver, `anvil info` (the host's measured AMX tile rate)
# 2. the CPU peak test on that host, and the CUDA tests (device, cast, device pool)
# 3. the planner's calibration for Llama 3 1B at seq 2048 and 8192 (anvil
#    calibrate + bench/gpu/calibrate.py), and the estimates with it
# 4. the PyTorch baseline rows (bench/gpu/torch_reference.py): 1B at 8192 and
#    2048, FSDP2 over one rank, AC none; 8B at 8192, AC full (3B on an H100)
# Steps that cannot run (no GPU, no CUDA PyTorch) say so and the rest go on.
set -uo pipefail
cd "$(dirname "$0")/../.."
pack=${1:-.gpu/anvil-gpu.tar.xz}
out=${OUT:-/tmp/anvil-gpu-check}
mkdir -p "$out"
root=/tmp/anvil-gpu
rm -rf "$root" && mkdir -p "$root"
tar -C "$root" -xJf "$pack" || { echo "check.sh: cannot unpack $pack (bench/gpu/pack.sh makes it)"; exit 1; }
export LD_LIBRARY_PATH="$root/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export PYTHONUNBUFFERED=1
anvil="$root/bin/anvil"
step() {  # step SECONDS TITLE CMD...: one step, its output and its exit status
  local secs=$1 title=$2
  shift 2
  echo
  echo "=== $title ($(date -u +%H:%M:%S), limit ${secs} s)"
  local t0=$SECONDS
  timeout -k 5 "$secs" "$@"
  local rc=$?
  echo "=== $title: exit $rc in $((SECONDS - t0)) s"
  return 0
}

step 20 "machine" sh -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1; date -u; git log -1 --format="commit %H" 2>/dev/null'
step 60 "anvil info" "$anvil" info
step 120 "cpu_peak_test" "$root/bin/cpu_peak_test" --gtest_brief=1
for t in "$root"/bin/cuda_*_test; do step 120 "$(basename "$t")" "$t" --gtest_brief=0; done

gpu=h200
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H100 && gpu=h100-80g
run1b="configs/llama3_1b.toml --hardware $gpu --gpus 1 --parallelism.fsdp_single_rank true --training.local_batch_size 1 --activation_checkpoint.mode none"
for seq in 2048 8192; do
  step 30 "shapes, 1B seq $seq" "$anvil" calibrate $run1b --training.seq_len $seq --shapes "$out/shapes-$seq.json"
done
python3 - "$out/shapes-2048.json" "$out/shapes-8192.json" "$out/shapes.json" <<'PY'
import json, sys
merged = {"gemms": [], "attention": []}
for path in sys.argv[1:3]:
    try:
        d = json.load(open(path))
    except OSError:
        continue
    for k in merged:
        for s in d.get(k, []):
            if s not in merged[k]:
                merged[k].append(s)
json.dump(merged, open(sys.argv[3], "w"), indent=2)
PY
step 240 "calibration" python3 bench/gpu/calibrate.py --shapes "$out/shapes.json" --output "$out/calibration.json"
for seq in 2048 8192; do
  step 30 "estimate, 1B seq $seq, published rates" "$anvil" estimate $run1b --training.seq_len $seq
  [ -s "$out/calibration.json" ] &&
    step 30 "estimate, 1B seq $seq, calibrated" "$anvil" estimate $run1b --training.seq_len $seq --calibration "$out/calibration.json"
done

big=8B
[ $gpu = h100-80g ] && big=3B
{
  step 150 "PyTorch 1B seq 8192 batch 1 AC none" python3 bench/gpu/torch_reference.py --flavor 1B --seq 8192 --ac none --fsdp-single-rank
  step 150 "PyTorch 1B seq 2048 batch 1 AC none" python3 bench/gpu/torch_reference.py --flavor 1B --seq 2048 --ac none --fsdp-single-rank
  step 240 "PyTorch $big seq 8192 batch 1 AC full" python3 bench/gpu/torch_reference.py --flavor $big --seq 8192 --ac full --fsdp-single-rank
} 2>&1 | tee "$out/torch_reference.log"
echo
echo "check.sh: done; files in $out"
