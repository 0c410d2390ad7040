#!/usr/bin/env python3
"""A torchtitan-style Llama 3 training step on one GPU, the PyTorch baseline Anvil's
GPU figures (and its planner's) are compared with, in the same run of the check script.

What torchtitan does at one GPU, either way:
  --fsdp-single-rank  FSDP2 fully_shard on every block and the root over a mesh of one
                      (MixedPrecisionPolicy bf16 parameters, fp32 reduction): 16 bytes per parameter
  (default)           no FSDP: fp32 model under torch.autocast(bfloat16), as maybe_enable_amp does
Both: fused AdamW (lr 8e-4, betas 0.9/0.95, weight decay 0.1), gradient clipping at 1.0,
eager (no torch.compile), SDPA attention, activation checkpointing none or full per block,
random tokens (the step's cost does not depend on them). It prints one JSON line: the
median step time of --steps steps after --warmup, tokens/s, torch.cuda.max_memory_allocated
and max_memory_reserved, and the device memory the process holds (cudaMemGetInfo before
and after).

    python3 bench/gpu/torch_reference.py --flavor 1B --seq 8192 --batch 1 --ac none --fsdp-single-rank

--device cpu runs a small flavour in fp32 without FSDP or autocast: a check of the model
code on any machine with PyTorch, not a baseline.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

# Llama 3 shapes, as Anvil's flavours (src/anvil/model/args.cpp): dim, layers, heads, kv heads,
# ffn multiplier (None: none), multiple_of, tied embeddings, vocab.
FLAVORS = {
    "debugmodel": (256, 6, 16, 16, None, 256, False, 2048),
    "1B": (2048, 16, 32, 8, 1.5, 256, True, 128256),
    "3B": (3072, 28, 24, 8, 1.0, 256, True, 128256),
    "8B": (4096, 32, 32, 8, 1.3, 1024, False, 128256),
}


def ffn_hidden(dim, multiplier, multiple_of):
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class RMSNorm(nn.Module):
    """nn.RMSNorm where PyTorch has it (2.4 and later), else the same sum written out (the CPU check)."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-5)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


def sdpa(q, k, v):
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    s = q.shape[-2]  # PyTorch before 2.0 (the CPU check only)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


def rope_cache(head_dim, seq, theta, device):
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim))
    t = torch.arange(seq, device=device, dtype=torch.float32)
    return torch.polar(torch.ones(seq, head_dim // 2, device=device), torch.outer(t, freqs))


def apply_rope(x, freqs):  # x: (b, s, h, d); torchtitan's complex rotation of pairs
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs[None, :, None, :]).flatten(3)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.h, self.kv, self.d = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.d, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.d, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.d, bias=False)
        self.wo = nn.Linear(heads * self.d, dim, bias=False)

    def forward(self, x, freqs):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.h, self.d)
        k = self.wk(x).view(b, s, self.kv, self.d)
        v = self.wv(x).view(b, s, self.kv, self.d)
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        rep = self.h // self.kv  # repeat_kv, as torchtitan does before SDPA
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        o = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(o.transpose(1, 2).contiguous().view(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, heads, kv_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x, freqs):
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, flavor, seq, ac):
        super().__init__()
        dim, layers, heads, kv, mult, multiple_of, tied, vocab = FLAVORS[flavor]
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv, ffn_hidden(dim, mult, multiple_of)) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight
        # theta 500,000; Llama 3.1's frequency scaling changes no cost and is left out
        self.register_buffer("freqs", rope_cache(dim // heads, seq, 500000.0, self.output.weight.device),
                             persistent=False)
        self.ac = ac

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            if self.ac == "full":
                h = torch.utils.checkpoint.checkpoint(layer, h, self.freqs, use_reentrant=False)
            else:
                h = layer(h, self.freqs)
        return self.output(self.norm(h))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="1B", choices=sorted(FLAVORS))
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ac", default="none", choices=["none", "full"])
    ap.add_argument("--fsdp-single-rank", action="store_true")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    dev = args.device
    torch.manual_seed(0)
    if dev == "cuda":
        free_before, total = torch.cuda.mem_get_info()
    vocab = FLAVORS[args.flavor][7]
    if dev == "cuda":
        with torch.device("cuda"):  # made on the GPU: an 8B model's CPU initialisation takes minutes
            model = Llama(args.flavor, args.seq, args.ac)
        if args.fsdp_single_rank:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29533")
            torch.distributed.init_process_group("nccl", rank=0, world_size=1)
            mesh = init_device_mesh("cuda", (1,))
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for i, layer in enumerate(model.layers):
                # torchtitan keeps the last block gathered after its forward: the backward needs it at once.
                fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(model.layers) - 1)
            fully_shard(model, mesh=mesh, mp_policy=mp)
    else:
        model = Llama(args.flavor, args.seq, args.ac)
    fused = {"fused": True} if dev == "cuda" else {}  # PyTorch 1.13's AdamW (the CPU check) has no fused
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1, **fused)
    autocast = dev == "cuda" and not args.fsdp_single_rank
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), device=dev)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step():
        opt.zero_grad()
        if autocast:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(inputs)
        else:
            pred = model(inputs)
        loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
        del pred
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, **({"foreach": True} if dev == "cuda" else {}))
        opt.step()
        return loss.item(), float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)

    times, losses = [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        loss, _ = step()  # .item() waits for the step's kernels
        if dev == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss)
    step_s = statistics.median(times)
    out = {
        "flavor": args.flavor, "seq": args.seq, "batch": args.batch, "ac": args.ac,
        "mode": "fsdp2 over one rank" if args.fsdp_single_rank else ("bf16 autocast" if autocast else "fp32 (cpu)"),
        "torch": torch.__version__, "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "parameters": sum(p.numel() for p in model.parameters()),
        "step_s": step_s, "tokens_per_s": args.batch * args.seq / step_s, "losses": losses,
    }
    if dev == "cuda":
        free_after, _ = torch.cuda.mem_get_info()
        out["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["max_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        out["device_memory_held_gib"] = (free_before - free_after) / 2**30
    print(json.dumps(out))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
