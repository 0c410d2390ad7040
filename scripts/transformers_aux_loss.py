"""Hugging Face transformers' own load-balancing loss of one MoE layer over one
sequence (load_balancing_loss_func of modeling_qwen3_moe, the function
Qwen3MoeForCausalLM adds to its loss): the outside pin of Anvil's
router_aux_loss (tests/moe_router_test.cpp's
MoeRouter.AuxLossIsTransformersLoadBalancingLoss).

    python scripts/transformers_aux_loss.py --case FILE:M:E:K [--case ...]

Each FILE holds one case's router logits, (M tokens, E experts) float32
little-endian, row by row, routed to the top K. Prints {"aux": [loss per case],
"transformers": version}; the losses are not scaled by a coefficient. Several
cases in one run import torch once. Runs in the oracles' environment
(scripts/setup_oracles.sh).
"""
import argparse
import json

import numpy as np
import torch
import transformers
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", required=True, metavar="FILE:M:E:K")
    args = ap.parse_args()
    losses = []
    for case in args.case:
        path, tokens, experts, top_k = case.rsplit(":", 3)
        tokens, experts, top_k = int(tokens), int(experts), int(top_k)
        logits = np.fromfile(path, dtype="<f4")
        if logits.size != tokens * experts:
            raise SystemExit(f"transformers_aux_loss: {path} holds {logits.size} floats, not {tokens} x {experts}")
        gate = torch.from_numpy(logits.reshape(tokens, experts).copy())
        # One layer's logits, as the model passes a tuple of every layer's; no attention mask: every token counts.
        losses.append(float(load_balancing_loss_func((gate,), experts, top_k)))
    print(json.dumps({"aux": losses, "transformers": transformers.__version__}))


if __name__ == "__main__":
    main()
