"""Greedy continuation of a prompt by Hugging Face transformers' own model
classes (AutoModelForCausalLM: LlamaForCausalLM, Qwen3ForCausalLM,
Qwen3MoeForCausalLM) loading a folder `anvil convert export` wrote, in fp32 on
the CPU, with transformers' KV cache: the outside check that an export means to
transformers what it means to Anvil, token for token (tests/generate_test.cpp's
Generate.GreedyDecodingMatchesTransformersTokenForToken).

Needs torch >= 2 and transformers >= 4.51 (the first with Qwen3 and
Qwen3-MoE), which Debian 12's python3-torch is not: scripts/setup_oracles.sh
makes the oracles' environment with both from PyPI.

    python scripts/transformers_generate.py --hf-generate FOLDER --prompt-ids 1,2,3 \
        --max-new-tokens 24 --out result.json

Writes {"tokens": [...], "margins": [...], "transformers": version}: the new
tokens and, per step, the top logit's lead over the second (a small lead is a
near-tie that rounding could flip). With --logits-out FILE it also writes the
logits of every position of the whole sequence (prompt and new tokens), from
one forward without the cache, as (positions, vocab) float32 little-endian:
what the scale of the output is, which the argmax alone cannot see.
"""
import argparse
import json

import torch
import transformers
from transformers import AutoModelForCausalLM


def generate(folder, prompt_ids, max_new_tokens, threads, logits_out=None):
    torch.set_num_threads(threads)
    model, info = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, output_loading_info=True)
    # Every weight from the file, none left to transformers' initialisation, none unread.
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(kind):
            raise SystemExit(f"transformers_generate: {folder}: {kind.replace('_', ' ')}: {info[kind]}")
    model.eval()
    # Every step runs: no end-of-sequence stop, no logit processing beyond argmax.
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=0,
                             return_dict_in_generate=True, output_scores=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    margins = []
    for step in out.scores:
        top2 = torch.topk(step[0].double(), 2).values
        margins.append(float(top2[0] - top2[1]))
    if logits_out:
        with torch.no_grad():
            whole = model(out.sequences, attention_mask=torch.ones_like(out.sequences), use_cache=False).logits[0]
        whole.float().numpy().astype("<f4").tofile(logits_out)
    return tokens, margins


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-generate", metavar="FOLDER", required=True, help="a Hugging Face folder (anvil convert export)")
    ap.add_argument("--prompt-ids", metavar="IDS", required=True, help="the prompt, comma-separated token ids")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--out", metavar="FILE", help="write the JSON result here too")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--logits-out", metavar="FILE", help="also write the whole sequence's logits here (float32)")
    args = ap.parse_args()
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    tokens, margins = generate(args.hf_generate, prompt, args.max_new_tokens, args.threads, args.logits_out)
    result = {"tokens": tokens, "margins": margins, "transformers": transformers.__version__}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
