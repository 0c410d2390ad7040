#!/usr/bin/env bash
# Encode throughput, one thread: Anvil's BPE tokenizer against the Python
# references, Hugging Face tokenizers (on data/tokenizers/llama3/tokenizer.json)
# and tiktoken (on Meta's data/tokenizers/llama3/tokenizer.model), all with
# Llama 3's vocabulary, on Shakespeare's plays (the train folder, concatenated)
# and on a mixed text, interleaved round by round. Only the encoding is timed
# on every side (not loading the vocabulary or printing ids). The references
# run through scripts/llama3_tokenizer.py's `time` mode in .venv.
#   bench/tokenizer_vs_hf.sh            ROUNDS (3)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
py=.venv/bin/python
[ -x build/anvil ] || { echo "build first: scripts/test.sh" >&2; exit 1; }
[ -x "$py" ] || { echo "the virtual environment .venv is missing; run scripts/setup.sh first" >&2; exit 1; }
scripts/prepare_data.sh >/dev/null
scripts/prepare_llama3_tokenizer.sh >/dev/null
tok=data/tokenizers/llama3/tokenizer.json
model=data/tokenizers/llama3/tokenizer.model
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

python3 - "$out" <<'PY'
import os, random, sys
out = sys.argv[1]
plays = sorted(os.path.join(d, n) for d, _, names in os.walk("data/shakespeare/train") for n in names if n.endswith(".txt"))
if not plays:
    sys.exit("no plays under data/shakespeare/train; run scripts/prepare_data.sh")
text = "".join(open(p, encoding="utf-8", errors="replace").read() for p in plays)
open(os.path.join(out, "shakespeare.txt"), "w", encoding="utf-8").write(text)
lines = [line for line in text.split("\n") if line.strip()]
random.seed(0)
parts = ["The café served crème brûlée; naïve résumés were déjà vu. ", "東京は日本の首都です。中文文本也在这里。",
         "Emoji: 😀🎉👩‍👩‍👧‍👦 ", "def f(x):\n    return x ** 2  # square\n", "Numbers 12345, 3.14159, 1e-9 and 2024-11-22. ",
         "    \t  spaces   and\n\n\nnewlines  ", "They'll say it's what we've done; I'm sure you'd agree. "]
text = "".join(random.choice(parts) + random.choice(lines) + "\n" for _ in range(40000))
open(os.path.join(out, "mixed.txt"), "w", encoding="utf-8").write(text)
PY

printf "| round | text | MB | Anvil MB/s | tokenizers MB/s | tiktoken MB/s | vs tokenizers | vs tiktoken | tokens equal |\n"
printf "|---|---|---|---|---|---|---|---|---|\n"
for r in $(seq 1 "$ROUNDS"); do
  for text in shakespeare mixed; do
    a=$(OMP_NUM_THREADS=1 build/anvil tokenizer encode --tokenizer "$tok" --stats < "$out/$text.txt" 2>&1 >/dev/null | tail -1)
    h=$(RAYON_NUM_THREADS=1 "$py" scripts/llama3_tokenizer.py time tokenizers "$tok" < "$out/$text.txt")
    t=$("$py" scripts/llama3_tokenizer.py time tiktoken "$model" < "$out/$text.txt")
    python3 - "$r" "$text" "$a" "$h" "$t" <<'PY'
import json, sys
r, text = sys.argv[1], sys.argv[2]
a, h, t = (json.loads(s) for s in sys.argv[3:6])
counts = (a["tokens"], h["tokens"], t["tokens"])
equal = "yes" if len(set(counts)) == 1 else "counts differ: anvil %d, tokenizers %d, tiktoken %d" % counts
print(f"| {r} | {text} | {a['bytes']/1e6:.1f} | {a['mb_per_s']:.1f} | {h['mb_per_s']:.2f} | {t['mb_per_s']:.2f} | "
      f"{a['mb_per_s']/h['mb_per_s']:.1f}x | {a['mb_per_s']/t['mb_per_s']:.1f}x | {equal} |")
PY
  done
done
