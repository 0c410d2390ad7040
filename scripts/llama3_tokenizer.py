"""Llama 3's tokenizer from Meta's tokenizer.model, for Anvil's parity test and benchmark.

Run with the project's virtual environment (scripts/setup.sh makes it, with
tokenizers and tiktoken):

  .venv/bin/python scripts/llama3_tokenizer.py convert tokenizer.model OUT.json
      writes a Hugging Face tokenizer.json (byte-level BPE, Llama 3's Split
      pattern, ignore_merges, Llama 3.1's 256 special tokens) that Anvil loads.
  .venv/bin/python scripts/llama3_tokenizer.py encode ENGINE PATH < docs.json > ids.json
      reads a JSON array of strings and writes a JSON array of id arrays,
      without BOS/EOS. ENGINE "tokenizers": Hugging Face tokenizers on the
      tokenizer.json at PATH; ENGINE "tiktoken": tiktoken on the tokenizer.model
      at PATH. Special-token text in a document encodes to its id on both.
  .venv/bin/python scripts/llama3_tokenizer.py time ENGINE PATH < text
      encodes stdin once (after loading) and prints
      {"bytes", "tokens", "seconds", "mb_per_s"} like `anvil tokenizer encode --stats`.

tokenizer.model is tiktoken's format: one "<base64 token bytes> <rank>" line per
token, 128,000 of them; a token's rank is its id and its merge priority.

tiktoken's limit: tiktoken 0.14 runs its pattern with a backtracking regex
engine, and a single run of about 1,000,000 whitespace characters without a
newline exceeds its backtracking stack (tiktoken raises ValueError; older
versions panicked). Meta's llama-models works around it by cutting the text
into 400,000-character slices and at 25,000 consecutive (non-)whitespace
characters, which can change the ids. This script cuts nothing, so its ids are
always those of the whole text; a document that trips the limit stops it with
an error that says so. Letters, digits, punctuation and newline-bearing
whitespace are not affected (2,000,000 of each encode), and the parity test's
longest whitespace run is 3,000 characters.
"""

import base64
import json
import os
import sys
import time

# Llama 3's pre-tokenizer pattern (Meta's tiktoken pat_str).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ORDINARY_TOKENS = 128000
SPECIAL_TOKENS = 256


def special_token_names():
    """Names of ids 128000-128255 as Hugging Face's Llama 3.1 tokenizer.json has them."""
    names = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|reserved_special_token_2|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    names += [f"<|reserved_special_token_{k}|>" for k in range(3, 3 + SPECIAL_TOKENS - len(names))]
    assert len(names) == SPECIAL_TOKENS and names[-1] == "<|reserved_special_token_247|>"
    return names


def fail(message):
    print(f"llama3_tokenizer: {message}", file=sys.stderr)
    sys.exit(1)


def load_ranks(path):
    """token bytes -> rank from a tiktoken file; the ranks must be 0..n-1, each once."""
    ranks = {}
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            fields = line.split()
            try:
                if len(fields) != 2:
                    raise ValueError("not two fields")
                token = base64.b64decode(fields[0], validate=True)
                rank = int(fields[1])
            except ValueError as e:
                fail(f'{path}:{line_no}: expected "<base64 token bytes> <rank>" ({e})')
            if not token or token in ranks:
                fail(f"{path}:{line_no}: empty or repeated token")
            ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        fail(f"{path}: the ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


def byte_alphabet():
    """GPT-2's byte -> printable character map, in which tokenizer.json spells tokens.

    Bytes that are printable Latin-1 characters (other than space and the
    soft hyphen) stand for themselves; the other 68 bytes take the characters
    from U+0100 on, in byte order.
    """
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    alphabet, extra = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[b] = chr(b)
        else:
            alphabet[b] = chr(0x100 + extra)
            extra += 1
    return alphabet


def merges_of(token, rank, ranks):
    """Every pair of tokens whose bytes join into `token`, by the left part's rank, then the right's.

    tiktoken has no merge list: it merges the lowest-ranked adjacent pair
    whose concatenation is a token, whichever split of that token the pair
    is. A merge list reproduces that when it holds every split, each at its
    token's rank. One merge per token (the pair that BPE over the token's own
    bytes ends in) is not enough: 678 of Llama 3's tokens do not reduce to
    two lower-ranked tokens that way (".:.:" stops at ".", ":.", ":"), and a
    longer piece can form a token from another of its splits. For Llama 3
    this gives 280,147 merges, as many as Hugging Face's Llama 3 tokenizer.json
    holds.
    """
    pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ranks and token[k:] in ranks]
    pairs.sort(key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
    return pairs


def convert(model_path, out_path):
    t0 = time.perf_counter()
    ranks = load_ranks(model_path)
    if len(ranks) != ORDINARY_TOKENS:
        fail(f"{model_path}: expected {ORDINARY_TOKENS} tokens, found {len(ranks)}")
    by_rank = sorted(ranks, key=ranks.get)
    alphabet = byte_alphabet()

    def spell(b):
        return "".join(alphabet[x] for x in b)

    vocab = {spell(tok): rank for rank, tok in enumerate(by_rank)}
    if len(vocab) != ORDINARY_TOKENS:
        fail("two tokens share a spelling in the byte alphabet")
    merges, unmerged = [], 0
    for rank, tok in enumerate(by_rank):
        if len(tok) > 1:
            pairs = merges_of(tok, rank, ranks)
            merges += [[spell(left), spell(right)] for left, right in pairs]
            unmerged += not pairs
    added = [
        {"id": ORDINARY_TOKENS + i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, name in enumerate(special_token_names())
    ]
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
            "vocab": vocab, "merges": merges,
        },
    }
    tmp = out_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(doc, ensure_ascii=False, separators=(",", ":")))
    os.replace(tmp, out_path)
    print(f"llama3_tokenizer: wrote {out_path} ({len(vocab)} tokens, {len(merges)} merges, {len(added)} special; "
          f"{unmerged} tokens no pair forms) "
          f"in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def load_encoder(engine, path):
    """A function str -> list of ids (no BOS/EOS; special-token text encodes to its id)."""
    if engine == "tokenizers":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(path)
        return lambda text: tok.encode(text, add_special_tokens=False).ids
    if engine == "tiktoken":
        import tiktoken

        ranks = load_ranks(path)
        specials = {name: len(ranks) + i for i, name in enumerate(special_token_names())}
        enc = tiktoken.Encoding(name="llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                special_tokens=specials)

        def encode(text):
            try:
                return enc.encode(text, allowed_special="all")
            except ValueError as e:
                fail(f"tiktoken cannot encode a text of {len(text)} characters whole ({e}); see the limit "
                     f"described at the top of {os.path.basename(__file__)}")

        return encode
    fail(f'unknown engine "{engine}" (tokenizers or tiktoken)')


def encode(engine, path):
    docs = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    if not isinstance(docs, list) or not all(isinstance(d, str) for d in docs):
        fail("stdin must be a JSON array of strings")
    enc = load_encoder(engine, path)
    sys.stdout.write(json.dumps([enc(d) for d in docs], separators=(",", ":")))


def time_encode(engine, path):
    text = sys.stdin.buffer.read().decode("utf-8", errors="replace")
    enc = load_encoder(engine, path)
    t0 = time.perf_counter()
    ids = enc(text)
    secs = time.perf_counter() - t0
    n = len(text.encode("utf-8"))
    print(json.dumps({"bytes": n, "tokens": len(ids), "seconds": secs, "mb_per_s": n / secs / 1e6}))


def main(argv):
    usage = ("usage: llama3_tokenizer.py convert tokenizer.model OUT.json | "
             "encode ENGINE PATH < docs.json > ids.json | time ENGINE PATH < text   (ENGINE: tokenizers or tiktoken)")
    if len(argv) == 3 and argv[0] == "convert":
        convert(argv[1], argv[2])
    elif len(argv) == 3 and argv[0] == "encode":
        encode(argv[1], argv[2])
    elif len(argv) == 3 and argv[0] == "time":
        time_encode(argv[1], argv[2])
    else:
        print(usage, file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main(sys.argv[1:])
