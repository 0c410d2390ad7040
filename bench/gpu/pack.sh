#!/usr/bin/env bash
# Packs what the GPU check (bench/gpu/check.sh) runs on the GPU machine: the
# CUDA build's binaries and the Debian shared libraries they load that the GPU
# machine's Ubuntu lacks (oneDNN, Open MPI, toml++, PCRE2, ...; not the C
# library, the C++ runtime, or CUDA's own, which are there), as .gpu/anvil-gpu.tar.xz.
# cuDNN is never packed: the binaries are built against cuDNN 9.14 from .venv
# (cmake/cuda.cmake), and their RUNPATH to that folder names nothing on the GPU
# machine, so there they load its own cuDNN 9.14, never the 9.19 of this
# machine's CUDA folder; `anvil info` prints the version loaded.
# Build first: cmake -S . -B build-cuda -DANVIL_CUDA=ON && cmake --build build-cuda
#
#   bench/gpu/pack.sh [BUILD_DIR [PACK]]      (defaults build-cuda, .gpu/anvil-gpu.tar.xz)
set -euo pipefail
pack=$(realpath -m "${2:-.gpu/anvil-gpu.tar.xz}")
cd "$(dirname "$0")/../.."
build=${1:-build-cuda}
[ -x "$build/anvil" ] || { echo "pack.sh: no $build/anvil; build the CUDA backend first (see the header)" >&2; exit 1; }
  "$build/anvil" info | grep -q "^CUDA runtime" ||
  { echo "pack.sh: $build/anvil has no CUDA backend (configure with -DANVIL_CUDA=ON)" >&2; exit 1; }
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib"
bins=("$build/anvil")
for t in cpu_peak_test gpu_plan_test gpu_calibration_test; do bins+=("$build/tests/$t"); done
for t in "$build"/tests/cuda_*_test; do bins+=("$t"); done
for b in "${bins[@]}"; do
  [ -x "$b" ] || { echo "pack.sh: no $b; build it first (ninja -C $build anvil anvil_cuda_tests cpu_peak_test gpu_plan_test gpu_calibration_test)" >&2; exit 1; }
done
cp "${bins[@]}" "$stage/bin/"
# The libraries each binary loads from Debian's tree, less those every Linux
# with CUDA has: glibc's, the C++ runtime, the GPU driver's and CUDA's.
skip='^(libc|libm|libdl|libpthread|librt|ld-linux-x86-64|libgcc_s|libstdc\+\+|libcuda|libcudart|libcublas|libcublasLt|libcudnn.*|libnvrtc.*|libnvJitLink)\.so'
for b in "${bins[@]}"; do
  ldd "$b" | awk '/=> \//{print $3}'
done | sort -u | while read -r lib; do
  name=$(basename "$lib")
  [[ $name =~ $skip ]] && continue
  cp -L "$lib" "$stage/lib/$name"
done
# The check (bench/gpu/check.sh) holds every library a packed binary loads to
# come from lib/ or to be one of these.
printf '%s\n' "$skip" >"$stage/system-libs.regex"
mkdir -p "$(dirname "$pack")"
tar -C "$stage" -cJf "$pack" bin lib system-libs.regex
echo "pack.sh: $pack ($(du -h "$pack" | cut -f1)): $(ls "$stage/bin" | wc -l) binaries, $(ls "$stage/lib" | wc -l) libraries"
