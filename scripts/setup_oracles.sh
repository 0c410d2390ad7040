#!/usr/bin/env bash
# Makes the oracles' environment: the PyPI packages, written by others, that
# tests hold Anvil against where Debian 12 has nothing new enough — torch and
# Hugging Face transformers (their Llama, Qwen3 and Qwen3-MoE classes decode
# and score Anvil's exports, and their load_balancing_loss_func pins the MoE
# aux loss), with lm-eval, megatron-core and pyarrow pinned beside them. The
# pins are scripts/oracles.txt.
#
# It lives outside the checkout, once per machine: $ANVIL_ORACLES, or
# ${XDG_CACHE_HOME:-~/.cache}/anvil/oracles (scripts/oracles_dir.sh), so every
# clone and every CI run on the machine reuses it. Under CI, .ci/run makes it
# on the host and scripts/fresh_debian_check.sh mounts it, read-only, at the
# same path in the fresh root, where the tests that need it fail if it is
# missing; elsewhere they are skipped, naming this script. PyPI's Linux torch
# wheel brings NVIDIA's CUDA libraries, so the first run fetches several GB
# (docs/README.md says how much and how long); later runs check the pins and
# fetch nothing. The oracles run on the CPU. Idempotent.
#
#   scripts/setup_oracles.sh && build/tests/generate_test --gtest_filter='*Transformers*'
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
dir=$(scripts/oracles_dir.sh)
mkdir -p "$(dirname "$dir")"
mapfile -t pins < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' scripts/oracles.txt)
t0=$SECONDS
ensure_venv setup_oracles "$dir" "${pins[@]}"
echo "setup_oracles: $dir ($(du -sh "$dir" | cut -f1)) ready after $((SECONDS - t0)) s"
