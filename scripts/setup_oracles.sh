#!/usr/bin/env bash
# Makes .venv-transformers: torch and Hugging Face transformers from PyPI, for
# the check that transformers' own model classes decode an Anvil export token
# for token as Anvil does (Generate.GreedyDecodingMatchesTransformersTokenForToken,
# scripts/transformers_generate.py). Debian 12's python3-torch (1.13) is too old
# for transformers' Qwen3 classes (4.51 and later), and PyPI's Linux torch
# wheel brings NVIDIA's CUDA libraries: about 5.5 GB, which is why the test
# command (scripts/test.sh) does not install it; without it that test is skipped.
# The check itself runs on the CPU, in fp32. Idempotent.
#
#   scripts/setup_transformers.sh && build/tests/generate_test --gtest_filter='*Transformers*'
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
echo "setup_transformers: torch and transformers from PyPI are about 5.5 GB"
ensure_venv setup_transformers .venv-transformers torch==2.6.0 transformers==4.51.3
