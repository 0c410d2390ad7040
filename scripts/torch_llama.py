#!/usr/bin/python3
"""A small PyTorch Llama (and Qwen3): the oracle Anvil's model is checked against, and the
baseline its speed is compared with. Run with Debian's Python (/usr/bin/python3,
which sees python3-torch), never inside Anvil.

Parity mode reads a folder written by Anvil's parity test:
  config.json          model shape and optimizer settings
  weights.safetensors  initial parameters (Hugging Face names, F32)
  batches.safetensors  tokens and targets, I32 (steps, B, T)
and writes
  torch_grads.safetensors  every parameter's gradient after the first step's backward
  torch_result.json        the loss of every step

HF-eval mode (--hf-eval FOLDER --tokens FILE) reads a Hugging Face Llama, Qwen3 or Qwen3-MoE folder
as `anvil convert export` writes it (config.json, model.safetensors or a
model.safetensors.index.json with shards; F32, BF16 or F16), builds the model
from config.json's fields alone, and prints the mean cross-entropy in fp32 of
the "tokens" and "targets" (I32, (B, T); target -100 is ignored) in FILE as one
JSON line (also written to --out when given).

HF-generate mode (--hf-generate FOLDER --prompt-ids 1,2,3 --max-new-tokens N)
continues the prompt greedily in fp32, recomputing the whole sequence every
step, and prints the new ids and each step's top-two logit margin as JSON.

Bench mode (--bench) times training steps of a flavour on the byte-tokenizer
stream of --data (default data/shakespeare/train): the tokens `anvil train`
reads from that folder with the `text` dataset and no tokenizer_path.

RoPE rotates halves (Hugging Face's rotate_half), as Anvil does.

Mixture of experts (config num_experts > 0), written from Qwen3-MoE's sparse block: the router's
softmax over the experts in the model's float type, the top experts_per_token by probability
(ties to the lower expert index: a stable descending sort), their weights renormalised when
norm_topk_prob; each expert a SwiGLU (mlp.experts.E.gate_proj/up_proj/down_proj) over the tokens
routed to it, its outputs weighted and added back per token (index_add_). The load-balancing loss is
Hugging Face's load_balancing_loss_func taken per sequence and layer, E * sum_e (n_e / T) * P_e, and
the loss trained is the cross-entropy plus router_aux_loss_coef times its mean over the layers and
the step's sequences. balanced_routing routes the token at position p of its sequence's slot j to expert
(p*k + j) mod E instead.
"""
import argparse
import json
import math
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    np_types = {"F32": np.float32, "I32": np.int32, "F16": np.float16}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        lo, hi = e["data_offsets"]
        if e["dtype"] == "BF16":
            raw = np.frombuffer(data[lo:hi], dtype=np.uint16).astype(np.uint32) << 16
            arr = raw.view(np.float32)
        else:
            arr = np.frombuffer(data[lo:hi], dtype=np_types[e["dtype"]])
            if arr.dtype == np.float16:
                arr = arr.astype(np.float32)  # exact: every f16 value is an f32 value
        out[name] = torch.from_numpy(arr.copy().reshape(e["shape"]))
    return out


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        b = t.detach().to(torch.float32).contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def inv_freq(head_dim, theta, scaling):
    f = [theta ** (-2.0 * i / head_dim) for i in range(head_dim // 2)]
    if scaling.get("enabled"):
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        orig = scaling["original_max_position"]
        out = []
        for fi in f:
            wavelen = 2 * math.pi / fi
            if wavelen < orig / hi:
                out.append(fi)
            elif wavelen > orig / lo:
                out.append(fi / factor)
            else:
                s = (orig / wavelen - lo) / (hi - lo)
                out.append((1 - s) * fi / factor + s * fi)
        f = out
    return torch.tensor(f, dtype=torch.float64)


def head_dim(cfg):
    """The heads' width: the config's head_dim (Qwen3), else dim / n_heads (Llama)."""
    return cfg.get("head_dim") or cfg["dim"] // cfg["n_heads"]


class Llama(torch.nn.Module):
    """Llama's block; with cfg["qk_norm"] Qwen3's, which normalises each query and key head (RMSNorm over
    head_dim, weights self_attn.q_norm / k_norm) before RoPE."""

    def __init__(self, cfg, weights):
        super().__init__()
        self.cfg = cfg
        self.params = torch.nn.ParameterDict()
        self.names = list(weights.keys())
        # float64: the whole model in double precision (a reference for the f32 one); else f32, or bf16 autocast.
        self.dtype = torch.float64 if cfg.get("float64") else torch.float32
        for name, w in weights.items():
            self.params[name.replace(".", "__")] = torch.nn.Parameter(w.clone().to(self.dtype))
        hd = head_dim(cfg)
        pos = torch.arange(cfg["max_seq_len"], dtype=torch.float64)
        ang = pos[:, None] * inv_freq(hd, cfg["rope_theta"], cfg["rope_scaling"])[None, :]
        self.cos, self.sin = ang.cos().to(self.dtype), ang.sin().to(self.dtype)
        # The auxiliary-loss-free balance's biases (float32, as Anvil keeps them), per layer.
        self.expert_bias = [torch.zeros(cfg.get("num_experts", 0), dtype=torch.float32)
                            for _ in range(cfg["n_layers"])]

    def update_expert_bias(self, counts):
        """DeepSeek-V3's step, as torchtitan applies it: each bias moves by the rate towards the mean load,
        less the moves' mean; in double, the experts summed in order, as Anvil does. counts: per layer, the
        step's routes per expert."""
        rate, E = self.cfg["moe_bias_update_rate"], self.cfg["num_experts"]
        for l, n in enumerate(counts):
            n = [float(c) for c in n]
            mean = sum(n) / E
            delta = [rate * (1.0 if c < mean else -1.0 if c > mean else 0.0) for c in n]
            mean_delta = sum(delta) / E
            b = [float(v) for v in self.expert_bias[l]]
            self.expert_bias[l] = torch.tensor([b[e] + (delta[e] - mean_delta) for e in range(E)],
                                               dtype=torch.float64).to(torch.float32)

    def p(self, name):
        return self.params[name.replace(".", "__")]

    def named(self):
        return [(n, self.p(n)) for n in self.names]

    def rms_norm(self, x, w):
        xf = x.to(self.dtype)  # f32 under autocast too
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg["norm_eps"])).to(x.dtype) * w

    def rope(self, x):  # x (B, T, H, D)
        T, half = x.shape[1], x.shape[-1] // 2
        c = self.cos[:T, None, :].to(x.dtype)
        s = self.sin[:T, None, :].to(x.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    def moe(self, x, pre, layer):
        """Qwen3-MoE's sparse block on x (B, T, D): the output, the sum of its sequences' load-balancing
        losses, and the chosen experts (B*T, k). With moe_sigmoid_scores each expert's score is its own
        sigmoid (DeepSeek-V3), and with moe_bias_update_rate the layer's expert biases are added to the
        scores to choose the experts, not to weight them."""
        cfg = self.cfg
        B, T, D = x.shape
        E, k = cfg["num_experts"], cfg["experts_per_token"]
        xf = x.reshape(B * T, D)
        logits = (xf @ self.p(pre + "mlp.gate.weight").t()).to(self.dtype)
        sigmoid = cfg.get("moe_sigmoid_scores", False)
        probs = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
        if cfg.get("balanced_routing"):
            experts = ((torch.arange(B * T) % T)[:, None] * k + torch.arange(k)[None, :]) % E
        else:
            choice = probs.detach()
            if cfg.get("moe_bias_update_rate", 0) > 0:
                choice = choice + self.expert_bias[layer].to(choice.dtype)
            experts = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k]
        weights = probs.gather(1, experts)
        if cfg.get("norm_topk_prob", True):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(xf.dtype)
        out = torch.zeros_like(xf)
        for e in range(E):
            tok, slot = (experts == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            xe = xf[tok]
            ex = f"{pre}mlp.experts.{e}."
            ye = (F.silu(xe @ self.p(ex + "gate_proj.weight").t()) * (xe @ self.p(ex + "up_proj.weight").t())) \
                @ self.p(ex + "down_proj.weight").t()
            out.index_add_(0, tok, ye * weights[tok, slot, None])
        aux = 0.0
        # Each token's share of expert e: its probability, or its sigmoid score over its scores' sum.
        share = probs / probs.sum(dim=-1, keepdim=True) if sigmoid else probs
        for b in range(B):  # per sequence: E * sum_e (tokens choosing e / T) * mean share of e
            rows = slice(b * T, (b + 1) * T)
            chose = F.one_hot(experts[rows], E).sum(dim=(0, 1)).to(probs.dtype)
            aux = aux + E * (chose / T * share[rows].mean(dim=0)).sum()
        return out.view(B, T, D), aux, experts

    def forward(self, tokens, targets, eos_id=None, with_moe=False):
        logits, aux, routes = self.run(tokens, eos_id)
        targets = targets.long().view(-1)
        loss_sum = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets, ignore_index=-100, reduction="sum")
        if with_moe:
            return loss_sum, int((targets != -100).sum()), aux, routes
        return loss_sum, int((targets != -100).sum())

    def logits(self, tokens, eos_id=None):
        logits, _, _ = self.run(tokens, eos_id)
        return logits

    def run(self, tokens, eos_id=None):
        """(B, T, V) fp32 logits of every position, the whole sequence recomputed; with experts, also the
        sum of the load-balancing losses over the layers and sequences, and each layer's chosen experts.
        With eos_id, attention is block-causal: an explicit boolean mask keeps the pairs of one document
        (a document ends at its EOS; the next token starts another)."""
        cfg = self.cfg
        B, T = tokens.shape
        Hq, Hkv = cfg["n_heads"], cfg["n_kv_heads"]
        hd = head_dim(cfg)
        h = F.embedding(tokens.long(), self.p("model.embed_tokens.weight"))
        aux, routes = 0.0, []
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        if eos_id is not None:
            eos = (tokens == eos_id).long()
            doc = torch.cumsum(eos, dim=1) - eos  # the EOS tokens before each position
            mask = (mask[None] & (doc[:, :, None] == doc[:, None, :]))[:, None]  # (B, 1, T, T)
        for l in range(cfg["n_layers"]):
            pre = f"model.layers.{l}."
            x = self.rms_norm(h, self.p(pre + "input_layernorm.weight"))
            q = (x @ self.p(pre + "self_attn.q_proj.weight").t()).view(B, T, Hq, hd)
            k = (x @ self.p(pre + "self_attn.k_proj.weight").t()).view(B, T, Hkv, hd)
            v = (x @ self.p(pre + "self_attn.v_proj.weight").t()).view(B, T, Hkv, hd)
            if cfg.get("qk_norm"):
                q = self.rms_norm(q, self.p(pre + "self_attn.q_norm.weight"))
                k = self.rms_norm(k, self.p(pre + "self_attn.k_norm.weight"))
            q, k = self.rope(q), self.rope(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            k = k.repeat_interleave(Hq // Hkv, dim=1)
            v = v.repeat_interleave(Hq // Hkv, dim=1)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            scores = scores.masked_fill(~mask, float("-inf"))
            att = torch.softmax(scores.to(self.dtype), dim=-1).to(q.dtype) @ v
            att = att.transpose(1, 2).reshape(B, T, Hq * hd)
            h = h + att @ self.p(pre + "self_attn.o_proj.weight").t()
            x = self.rms_norm(h, self.p(pre + "post_attention_layernorm.weight"))
            if cfg.get("num_experts"):
                y, layer_aux, experts = self.moe(x, pre, l)
                h = h + y
                aux = aux + layer_aux
                routes.append(experts)
                continue
            g = x @ self.p(pre + "mlp.gate_proj.weight").t()
            u = x @ self.p(pre + "mlp.up_proj.weight").t()
            h = h + (F.silu(g) * u) @ self.p(pre + "mlp.down_proj.weight").t()
        h = self.rms_norm(h, self.p("model.norm.weight"))
        out_w = self.p("model.embed_tokens.weight") if cfg["tie_embeddings"] else self.p("lm_head.weight")
        return (h @ out_w.t()).to(self.dtype), aux, routes


def make_optimizers(opt, named):
    """AdamW over every parameter; or, with opt["name"] == "Muon", torch.optim.Muon (torch 2.9 and later) over the
    hidden matrices, Moonlight's and torchtitan's choice written here on its own: every 2-D parameter of a
    transformer block but a mixture of experts' router (mlp.gate.weight), each expert's matrices their own
    parameters; and AdamW over the rest (the embedding, the norms, the head, the router). opt["ns_dtype"] "f32"
    runs Newton-Schulz without its bf16 cast (torch_muon.py's patch)."""
    named = list(named)
    if opt.get("name", "AdamW") != "Muon":
        return [torch.optim.AdamW([p for _, p in named], lr=opt["lr"], betas=(opt["beta1"], opt["beta2"]),
                                  eps=opt["eps"], weight_decay=opt["weight_decay"])]
    import torch.optim._muon as muon_module
    if opt["ns_dtype"] == "f32":
        from torch_muon import f32_newton_schulz
        muon_module._zeropower_via_newtonschulz = f32_newton_schulz()

    def hidden(name, p):
        return name.startswith("model.layers.") and p.dim() == 2 and not name.endswith(".mlp.gate.weight")

    matrices = [p for name, p in named if hidden(name, p)]
    rest = [p for name, p in named if not hidden(name, p)]
    return [torch.optim.Muon(matrices, lr=opt["muon_lr"], weight_decay=opt["muon_weight_decay"],
                             momentum=opt["muon_momentum"], nesterov=opt["muon_nesterov"],
                             ns_steps=opt["muon_ns_steps"], eps=opt["muon_eps"],
                             adjust_lr_fn=opt["muon_adjust_lr_fn"]),
            torch.optim.AdamW(rest, lr=opt["lr"], betas=(opt["beta1"], opt["beta2"]), eps=opt["eps"],
                              weight_decay=opt["weight_decay"])]


def parity(folder, threads):
    torch.set_num_threads(threads)
    cfg = json.load(open(f"{folder}/config.json"))
    weights = read_safetensors(f"{folder}/weights.safetensors")
    batches = read_safetensors(f"{folder}/batches.safetensors")
    model = Llama(cfg, weights)
    optimizers = make_optimizers(cfg["optimizer"], model.named())
    bf16 = cfg.get("compute_dtype") == "bf16"
    eos_id = cfg.get("eos_id")  # block-causal attention when given
    micro_batches = cfg.get("micro_batches", 1)  # gradient accumulation over slices of the batch's rows
    steps = batches["tokens"].shape[0]
    # The load-balancing loss: coef times its mean over the layers and the step's sequences.
    aux_scale = cfg.get("router_aux_loss_coef", 0.0) / (cfg["n_layers"] * batches["tokens"].shape[1])
    losses, aux_losses, routes = [], [], {}
    for step in range(steps):
        for o in optimizers:
            o.zero_grad()
        tokens, targets = batches["tokens"][step], batches["targets"][step]
        if step == 0 and cfg.get("logits"):  # the first batch's logits at the initial weights, (B, T, V)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                write_safetensors(f"{folder}/torch_logits.safetensors", {"logits": model.logits(tokens, eos_id)})
        n = int((targets != -100).sum())  # the step's tokens normalise every micro-batch's loss
        total, aux_total = 0.0, 0.0
        step_counts = [[0] * cfg.get("num_experts", 0) for _ in range(cfg["n_layers"])]  # routes per expert
        for m, (tok, tgt) in enumerate(zip(tokens.chunk(micro_batches), targets.chunk(micro_batches))):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss_sum, _, aux, layer_routes = model(tok, tgt, eos_id, with_moe=True)
            (loss_sum / n + aux_scale * aux).backward()
            total += float(loss_sum)
            aux_total += float(aux)
            for l, experts in enumerate(layer_routes):  # f32 holds expert indices exactly
                routes[f"step{step}.micro_batch{m}.layer{l}"] = experts.to(torch.float32)
                for e, c in enumerate(torch.bincount(experts.flatten(), minlength=cfg["num_experts"]).tolist()):
                    step_counts[l][e] += c
        # An expert no token reached has a zero gradient, not none: its weights still decay, as with the
        # experts as one (E, ., .) tensor (Anvil's, and torchtitan's grouped experts).
        for _, p in model.named():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        losses.append(total / n)
        aux_losses.append(aux_total / (cfg["n_layers"] * tokens.shape[0]))
        if step == 0:
            write_safetensors(f"{folder}/torch_grads.safetensors", {name: p.grad for name, p in model.named()})
        if step == steps - 1 and cfg.get("last_grads"):
            # With the weights they were taken at, so the other side can compare this step alone.
            write_safetensors(f"{folder}/torch_grads_last.safetensors", {name: p.grad for name, p in model.named()})
            write_safetensors(f"{folder}/torch_weights_last.safetensors", {name: p.detach() for name, p in model.named()})
        for o in optimizers:
            o.step()
        if cfg.get("moe_bias_update_rate", 0) > 0:
            model.update_expert_bias(step_counts)
    result = {"losses": losses, "aux_losses": aux_losses}
    if cfg.get("bf16_matmul_error"):  # this torch's bf16 product against the exact one of its inputs, at K = 2048
        torch.manual_seed(0)
        a, b = torch.randn(64, 2048).bfloat16(), torch.randn(2048, 64).bfloat16()
        exact = a.double() @ b.double()
        result["bf16_matmul_error"] = ((a @ b).double() - exact).norm().item() / exact.norm().item()
    if cfg.get("moe_bias_update_rate", 0) > 0:  # float32 values, written exactly
        result["expert_bias"] = [float(b) for layer in model.expert_bias for b in layer.tolist()]
    json.dump(result, open(f"{folder}/torch_result.json", "w"))
    if routes:
        write_safetensors(f"{folder}/torch_routes.safetensors", routes)
    if cfg.get("final_weights"):
        write_safetensors(f"{folder}/torch_weights_final.safetensors", {name: p.detach() for name, p in model.named()})


def read_hf_weights(folder):
    """Every tensor of a Hugging Face folder: model.safetensors, or the shards of its index."""
    import os
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(single):
        return read_safetensors(single)
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(read_safetensors(os.path.join(folder, shard)))
    return {name: out[name] for name in index["weight_map"]}


def hf_model(folder, max_seq_len):
    """A Hugging Face Llama, Qwen3 or Qwen3-MoE folder as the model above in fp32, built from config.json's
    fields alone."""
    hf = json.load(open(f"{folder}/config.json"))
    qwen3 = hf["model_type"] in ("qwen3", "qwen3_moe")
    moe = hf["model_type"] == "qwen3_moe"
    assert hf["model_type"] in ("llama", "qwen3", "qwen3_moe") and hf.get("hidden_act", "silu") == "silu", hf
    if moe:  # Qwen3MoeConfig's defaults; every layer sparse
        assert hf.get("decoder_sparse_step", 1) == 1 and not hf.get("mlp_only_layers"), "dense layers not modelled"
    assert not hf.get("attention_bias", False) and not hf.get("mlp_bias", False), "biases are not modelled here"
    assert not hf.get("use_sliding_window", False), "sliding-window attention is not modelled here"
    heads = hf["num_attention_heads"]
    # LlamaConfig's default head_dim is hidden_size / heads; Qwen3Config's is 128.
    hd = hf.get("head_dim") or (128 if qwen3 else hf["hidden_size"] // heads)
    rs = hf.get("rope_scaling")
    if rs is not None and rs.get("rope_type", rs.get("type")) == "llama3":
        scaling = {"enabled": True, "factor": rs["factor"], "low_freq_factor": rs["low_freq_factor"],
                   "high_freq_factor": rs["high_freq_factor"],
                   "original_max_position": rs["original_max_position_embeddings"]}
    else:
        assert rs is None or rs.get("rope_type", rs.get("type")) == "default", f"rope_scaling {rs} not modelled"
        scaling = {"enabled": False}
    cfg = {"dim": hf["hidden_size"], "n_layers": hf["num_hidden_layers"], "n_heads": heads,
           "n_kv_heads": hf.get("num_key_value_heads", heads), "norm_eps": hf.get("rms_norm_eps", 1e-6),
           "rope_theta": hf.get("rope_theta", 10000.0), "rope_scaling": scaling, "max_seq_len": max_seq_len,
           "tie_embeddings": hf.get("tie_word_embeddings", False), "head_dim": hd, "qk_norm": qwen3}
    if moe:
        cfg.update({"num_experts": hf.get("num_experts", 128), "experts_per_token": hf.get("num_experts_per_tok", 8),
                    "norm_topk_prob": hf.get("norm_topk_prob", False)})
    weights = read_hf_weights(folder)
    weights = {n: w for n, w in weights.items() if not n.endswith("rotary_emb.inv_freq")}
    # The weights must be exactly what config.json describes.
    D, F_, V = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    want = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg["tie_embeddings"]:
        want["lm_head.weight"] = (V, D)
    for l in range(cfg["n_layers"]):
        p = f"model.layers.{l}."
        want.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                     p + "self_attn.q_proj.weight": (heads * hd, D),
                     p + "self_attn.k_proj.weight": (cfg["n_kv_heads"] * hd, D),
                     p + "self_attn.v_proj.weight": (cfg["n_kv_heads"] * hd, D),
                     p + "self_attn.o_proj.weight": (D, heads * hd)})
        if moe:
            E, Fm = cfg["num_experts"], hf.get("moe_intermediate_size", 768)
            want[p + "mlp.gate.weight"] = (E, D)
            for e in range(E):
                want.update({f"{p}mlp.experts.{e}.gate_proj.weight": (Fm, D),
                             f"{p}mlp.experts.{e}.up_proj.weight": (Fm, D),
                             f"{p}mlp.experts.{e}.down_proj.weight": (D, Fm)})
        else:
            want.update({p + "mlp.gate_proj.weight": (F_, D), p + "mlp.up_proj.weight": (F_, D),
                         p + "mlp.down_proj.weight": (D, F_)})
        if qwen3:
            want.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    got = {n: tuple(w.shape) for n, w in weights.items()}
    assert got == want, f"weights do not match config.json: {set(got.items()) ^ set(want.items())}"
    return Llama(cfg, weights)


def hf_eval(folder, tokens_path, out_path, threads):
    """Mean cross-entropy of a Hugging Face Llama or Qwen3 folder in fp32, the model built from config.json alone."""
    torch.set_num_threads(threads)
    batch = read_safetensors(tokens_path)
    tokens, targets = batch["tokens"], batch["targets"]
    model = hf_model(folder, tokens.shape[-1])
    with torch.no_grad():
        loss_sum, n = model(tokens.view(-1, tokens.shape[-1]), targets.view(-1, targets.shape[-1]))
    result = {"loss": float(loss_sum) / n, "loss_sum": float(loss_sum), "tokens": n}
    print(json.dumps(result))
    if out_path:
        json.dump(result, open(out_path, "w"))


def hf_generate(folder, prompt_ids, max_new_tokens, out_path, threads, logits_out=None):
    """Greedy continuation of a prompt by a Hugging Face Llama or Qwen3 folder in fp32, every step recomputing the whole
    sequence (no cache): the oracle for Anvil's cached decoding. Writes the new ids and each step's top-two
    logit margin (how far the choice was from a tie) as JSON; with logits_out, the logits of every position of the
    whole sequence (prompt and new ids), (positions, vocab) float32 little-endian, row by row."""
    torch.set_num_threads(threads)
    ids = [int(t) for t in prompt_ids.split(",")]
    model = hf_model(folder, len(ids) + max_new_tokens)
    new, margins = [], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model.logits(torch.tensor([ids], dtype=torch.int32))[0, -1]
            top = torch.topk(logits, 2)
            ids.append(int(top.indices[0]))
            new.append(ids[-1])
            margins.append(float(top.values[0] - top.values[1]))
        if logits_out:
            model.logits(torch.tensor([ids], dtype=torch.int32))[0].float().numpy().astype("<f4").tofile(logits_out)
    result = {"tokens": new, "margins": margins}
    print(json.dumps(result))
    if out_path:
        json.dump(result, open(out_path, "w"))


FLAVORS = {  # name: (dim, n_layers, n_heads, n_kv_heads, vocab, ffn_hidden, rope_theta)
    "debugmodel": (256, 6, 16, 16, 2048, 768, 500000.0),
    "25M": (512, 6, 8, 4, 8192, 1536, 500000.0),
    "125M": (768, 12, 12, 4, 32000, 2048, 500000.0),
}


def text_byte_stream(folder):
    """The byte-tokenizer stream of Anvil's `text` dataset at `folder` (data/text_source.cpp,
    DocumentTokenSource): the file itself, or every regular file below the folder, sorted by
    path as bytes (std::string's order); each file one document, BOS=256, its raw bytes,
    EOS=257. Only plain text is mirrored: JSON Lines names (several documents a file) and
    gzip data are refused, and an empty file is an error, as in Anvil."""
    import os
    root = os.fsencode(folder)  # bytes paths sort as Anvil's do, whatever the file names
    paths = [root] if os.path.isfile(root) else sorted(
        os.path.join(d, n) for d, _, names in os.walk(root, followlinks=True) for n in names
        if os.path.isfile(os.path.join(d, n)))
    if not paths:
        raise SystemExit(f"no files in {folder}; run scripts/prepare_data.sh")
    docs = []
    for path in paths:
        name = os.fsdecode(path)
        if name.endswith((".json", ".jsonl", ".json.gz", ".jsonl.gz")):
            raise SystemExit(f"{name}: JSON Lines input is not mirrored here; give a folder of plain text files")
        data = open(path, "rb").read()
        if not data:
            raise SystemExit(f"{name}: the file is empty")
        if data[:2] == b"\x1f\x8b":  # Anvil's gzread would decompress it
            raise SystemExit(f"{name}: gzip input is not mirrored here; give plain text files")
        docs += [np.array([256], np.int32), np.frombuffer(data, np.uint8).astype(np.int32), np.array([257], np.int32)]
    return torch.from_numpy(np.concatenate(docs))


def bench(args):
    """Times training steps of a flavour on --data (Shakespeare's train works by default); prints one JSON line."""
    import resource
    import time
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dim, layers, heads, kv, vocab, ffn, theta = FLAVORS[args.flavor]
    hd = dim // heads
    shapes = {"model.embed_tokens.weight": (vocab, dim), "model.norm.weight": (dim,), "lm_head.weight": (vocab, dim)}
    for l in range(layers):
        p = f"model.layers.{l}."
        shapes.update({p + "input_layernorm.weight": (dim,), p + "post_attention_layernorm.weight": (dim,),
                       p + "self_attn.q_proj.weight": (heads * hd, dim), p + "self_attn.k_proj.weight": (kv * hd, dim),
                       p + "self_attn.v_proj.weight": (kv * hd, dim), p + "self_attn.o_proj.weight": (dim, heads * hd),
                       p + "mlp.gate_proj.weight": (ffn, dim), p + "mlp.up_proj.weight": (ffn, dim),
                       p + "mlp.down_proj.weight": (dim, ffn)})
    weights = {n: (torch.ones(s) if len(s) == 1 else torch.randn(s) * 0.02) for n, s in shapes.items()}
    cfg = {"dim": dim, "n_layers": layers, "n_heads": heads, "n_kv_heads": kv, "norm_eps": 1e-5,
           "rope_theta": theta, "rope_scaling": {"enabled": False}, "max_seq_len": args.seq_len,
           "tie_embeddings": False}
    model = Llama(cfg, weights)
    opt = torch.optim.AdamW([p for _, p in model.named()], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    stream = text_byte_stream(args.data)
    B, T = args.batch, args.seq_len
    pos = 0
    times = []
    for step in range(args.warmup + args.steps):
        n = B * T + 1
        if pos + n > len(stream):
            pos = 0
        window = stream[pos:pos + B * T + 1]
        pos += B * T
        tokens = window[:-1].view(B, T)
        targets = window[1:].view(B, T)
        t0 = time.perf_counter()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            loss_sum, ntok = model(tokens, targets)
        (loss_sum / ntok).backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in model.named()], 1.0)
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    tok_s = B * T * len(times) / sum(times)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"tokens_per_s": tok_s, "peak_rss_bytes": rss, "loss": float(loss_sum) / ntok}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parity", metavar="FOLDER", help="run the parity check on a folder written by Anvil")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bench", action="store_true", help="time training steps (see --flavor ...)")
    ap.add_argument("--flavor", default="debugmodel", choices=sorted(FLAVORS))
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--data", default="data/shakespeare/train",
                    help="--bench's corpus: a folder of plain text files, read as Anvil's text dataset reads it")
    ap.add_argument("--hf-eval", metavar="FOLDER", help="mean cross-entropy of a Hugging Face Llama or Qwen3 folder (fp32)")
    ap.add_argument("--tokens", metavar="FILE", help="--hf-eval's tokens and targets (safetensors, I32)")
    ap.add_argument("--out", metavar="FILE", help="--hf-eval and --hf-generate also write their JSON result here")
    ap.add_argument("--hf-generate", metavar="FOLDER", help="greedy continuation by a Hugging Face Llama or Qwen3 folder (fp32)")
    ap.add_argument("--prompt-ids", metavar="IDS", help="--hf-generate's prompt, comma-separated token ids")
    ap.add_argument("--logits-out", metavar="FILE",
                    help="--hf-generate also writes the logits of the whole sequence here (positions x vocab, float32)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args()
    if args.parity:
        parity(args.parity, args.threads)
    elif args.hf_eval:
        if not args.tokens:
            ap.error("--hf-eval needs --tokens")
        hf_eval(args.hf_eval, args.tokens, args.out, args.threads)
    elif args.hf_generate:
        if not args.prompt_ids:
            ap.error("--hf-generate needs --prompt-ids")
        hf_generate(args.hf_generate, args.prompt_ids, args.max_new_tokens, args.out, args.threads, args.logits_out)
    elif args.bench:
        bench(args)
    else:
        ap.print_help()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
