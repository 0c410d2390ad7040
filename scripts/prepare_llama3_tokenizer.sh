#!/usr/bin/env bash
# Builds data/tokenizers/llama3/: Meta's Llama 3 tokenizer.model (tiktoken
# format, 128,000 ranked tokens), taken from the PyPI wheel llama-models 0.3.0
# and checked by sha256, and tokenizer.json, the same vocabulary in Hugging
# Face format (scripts/llama3_tokenizer.py convert) that Anvil loads.
# tokenizer.model is also the tiktoken reference of the parity test.
# Idempotent. Needs the virtual environment .venv that scripts/setup.sh makes.
set -euo pipefail
cd "$(dirname "$0")/.."

dest=data/tokenizers/llama3
wheel_version=0.3.0
model_sha256=82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55
py=.venv/bin/python

model_ok() {
  [ -s "$dest/tokenizer.model" ] &&
    [ "$(sha256sum "$dest/tokenizer.model" | cut -d' ' -f1)" = "$model_sha256" ]
}

if [ -s "$dest/tokenizer.json" ] && model_ok; then
  echo "prepare_llama3_tokenizer: $dest/tokenizer.model and tokenizer.json already exist"
  exit 0
fi
if [ ! -x "$py" ] || [ ! -x .venv/bin/pip ]; then
  echo "prepare_llama3_tokenizer: the virtual environment .venv is missing; run scripts/setup.sh first" >&2
  exit 1
fi
mkdir -p "$dest"
rm -rf "$dest/js"  # the npm package that earlier versions of this script kept
if ! model_ok; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "prepare_llama3_tokenizer: fetching the llama-models $wheel_version wheel with pip"
  .venv/bin/pip download --quiet --no-deps --disable-pip-version-check -d "$tmp" "llama-models==$wheel_version"
  wheel=("$tmp"/llama_models-"$wheel_version"-*.whl)
  if [ ! -f "${wheel[0]}" ]; then
    echo "prepare_llama3_tokenizer: pip downloaded no llama_models-$wheel_version wheel into $tmp" >&2
    exit 1
  fi
  "$py" - "${wheel[0]}" "$dest/tokenizer.model.tmp" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z, open(out, "wb") as f:
    f.write(z.read("llama_models/llama3/tokenizer.model"))
PY
  got=$(sha256sum "$dest/tokenizer.model.tmp" | cut -d' ' -f1)
  if [ "$got" != "$model_sha256" ]; then
    rm -f "$dest/tokenizer.model.tmp"
    echo "prepare_llama3_tokenizer: tokenizer.model in the wheel has sha256 $got, expected $model_sha256" >&2
    exit 1
  fi
  mv "$dest/tokenizer.model.tmp" "$dest/tokenizer.model"
  # A tokenizer.json from another tokenizer.model is stale.
  rm -f "$dest/tokenizer.json"
fi
"$py" scripts/llama3_tokenizer.py convert "$dest/tokenizer.model" "$dest/tokenizer.json"
echo "prepare_llama3_tokenizer: $(du -h "$dest/tokenizer.json" | cut -f1) in $dest/tokenizer.json," \
  "$(du -h "$dest/tokenizer.model" | cut -f1) in $dest/tokenizer.model"
