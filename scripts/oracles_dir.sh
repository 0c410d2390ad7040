#!/usr/bin/env bash
# Prints where the oracles' environment lives (scripts/setup_oracles.sh makes
# it): $ANVIL_ORACLES, or ${XDG_CACHE_HOME:-$HOME/.cache}/anvil/oracles.
# tests/oracles.h finds it by the same rule.
echo "${ANVIL_ORACLES:-${XDG_CACHE_HOME:-$HOME/.cache}/anvil/oracles}"
