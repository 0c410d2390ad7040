#!/usr/bin/env bash
# ctest CudaGpuCheck.Rehearsal: the one-call GPU check (bench/gpu/check.sh)
# rehearsed without a GPU over a pack of this build (bench/gpu/pack.sh), so the
# GPU machine's scarce minutes never find a pack that does not unpack, a binary
# that cannot load its libraries, a step that overruns, or JSON that does not
# parse. Then twice broken, since a rehearsal that cannot fail proves nothing:
# a truncated pack, and a pack missing a library that this machine happens to
# have elsewhere (the GPU machine does not).
#
#   gpu_check_rehearsal.sh BUILD_DIR SCRATCH_DIR
set -euo pipefail
build=$(realpath "$1")
scratch=$2
here=$(cd "$(dirname "$0")" && pwd)
check=$here/../../bench/gpu/check.sh
rm -rf "$scratch" && mkdir -p "$scratch"

# xz -0: the format the GPU machine unpacks, in a fraction of -6's time.
XZ_OPT=-0 bash "$here/../../bench/gpu/pack.sh" "$build" "$scratch/anvil-gpu.tar.xz"

rehearse() {  # rehearse NAME PACK EXPECT [OPTION...]: the check on PACK, its output and JSON held to EXPECT
  local rc=0 t0=$SECONDS
  bash "$check" --rehearse --out "$scratch/$1" "${@:4}" "$2" >"$scratch/$1.stdout" 2>&1 || rc=$?
  echo "== $1: check.sh exit $rc in $((SECONDS - t0)) s; the end of its output:"
  tail -14 "$scratch/$1.stdout"
  python3 "$here/gpu_check_validate.py" "$scratch/$1" "$rc" "$scratch/$1.stdout" "$3"
}

rehearse good "$scratch/anvil-gpu.tar.xz" good

head -c 200000 "$scratch/anvil-gpu.tar.xz" >"$scratch/truncated.tar.xz"
rehearse truncated "$scratch/truncated.tar.xz" truncated

# oneDNN: loaded by anvil and several tests, installed on this machine, absent on the GPU machine.
# The machine step alone finds it (--only 01): the later steps would run as in the good pack's
# rehearsal, with this machine's oneDNN, proving nothing more for twice the time.
mkdir "$scratch/unpacked"
tar -C "$scratch/unpacked" -xf "$scratch/anvil-gpu.tar.xz"
rm "$scratch/unpacked"/lib/libdnnl.so*
tar -C "$scratch/unpacked" -cf "$scratch/no-onednn.tar" .
rehearse no-onednn "$scratch/no-onednn.tar" missing-library --only 01
rm -rf "$scratch/unpacked"
