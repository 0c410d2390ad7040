#!/usr/bin/env bash
# Encode throughput, one thread: Anvil's BPE tokenizer against the JS reference
# (npm's llama3-tokenizer-js, in Node), both with Llama 3's vocabulary, on the
# Brown corpus and on a mixed text, interleaved round by round. Only the
# encoding is timed on both sides (not loading the vocabulary or printing ids).
#   bench/tokenizer_vs_js.sh            ROUNDS (3)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
[ -x build/anvil ] || { echo "build first: scripts/test.sh" >&2; exit 1; }
scripts/prepare_data.sh >/dev/null
scripts/prepare_llama3_tokenizer.sh >/dev/null
tok=data/tokenizers/llama3/tokenizer.json
pkg=data/tokenizers/llama3/js
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

python3 - "$out" <<'PY'
import os, random, sys
out = sys.argv[1]
lines = []
for name in sorted(n for n in os.listdir("data/brown") if len(n) == 4 and n[0] == "c"):
    for line in open(os.path.join("data/brown", name), encoding="utf-8", errors="replace"):
        words = [t[:t.rfind("/")] if t.rfind("/") > 0 else t for t in line.split()]
        if words:
            lines.append(" ".join(words))
open(os.path.join(out, "brown.txt"), "w", encoding="utf-8").write("\n".join(lines) + "\n")
random.seed(0)
parts = ["The café served crème brûlée; naïve résumés were déjà vu. ", "東京は日本の首都です。中文文本也在这里。",
         "Emoji: 😀🎉👩‍👩‍👧‍👦 ", "def f(x):\n    return x ** 2  # square\n", "Numbers 12345, 3.14159, 1e-9 and 2024-11-22. ",
         "    \t  spaces   and\n\n\nnewlines  ", "They'll say it's what we've done; I'm sure you'd agree. "]
text = "".join(random.choice(parts) + random.choice(lines) + "\n" for _ in range(40000))
open(os.path.join(out, "mixed.txt"), "w", encoding="utf-8").write(text)
PY

printf "| round | text | MB | Anvil MB/s | JS MB/s | ratio | tokens equal |\n|---|---|---|---|---|---|---|\n"
for r in $(seq 1 "$ROUNDS"); do
  for text in brown mixed; do
    a=$(OMP_NUM_THREADS=1 build/anvil tokenizer encode --tokenizer "$tok" --stats < "$out/$text.txt" 2>&1 >/dev/null | tail -1)
    j=$(node scripts/llama3_tokenizer.mjs time "$pkg" < "$out/$text.txt")
    python3 - "$r" "$text" "$a" "$j" <<'PY'
import json, sys
r, text, a, j = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
print(f"| {r} | {text} | {a['bytes']/1e6:.1f} | {a['mb_per_s']:.1f} | {j['mb_per_s']:.2f} | "
      f"{a['mb_per_s']/j['mb_per_s']:.1f}x | {'yes' if a['tokens'] == j['tokens'] else 'counts differ: %d vs %d' % (a['tokens'], j['tokens'])} |")
PY
  done
done
