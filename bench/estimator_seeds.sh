#!/usr/bin/env bash
# The GPU-cluster planner against the published seeds: seed 000 (FSDP 2 x PP 2,
# the last stage's memory against the micro-batch count, torch's max reserved)
# and seed 001 (torchtitan's FSDP2 tokens/s per GPU and MFU on 64 A100-80GB,
# and the footnote's out-of-memory rows). Prints the markdown tables that
# docs/estimator.md shows, each row with its error. No GPU needed: these are
# predictions from published hardware figures and measured kernel rates
# (src/anvil/estimate/gpu_hardware.cpp). The last line counts the rows within
# the targets (seed 000 10%, seed 001 15%).
#
#   bench/estimator_seeds.sh
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x build/anvil ] || { echo "build first: scripts/test.sh or scripts/train.sh" >&2; exit 1; }
exec build/anvil plan --seeds
