#!/usr/bin/env python3
"""torch.optim.Muon (PyTorch 2.9 and later) on matrices written by tests/muon_test.cpp: the oracle for
Anvil's Muon (src/anvil/ops/muon.h).

  torch_muon.py FOLDER [--threads N]

FOLDER/config.json: {"cases": [{"name", "rows", "cols", "steps", "lr", "weight_decay", "momentum",
"nesterov", "ns_steps", "eps", "adjust_lr_fn", "ns_dtype"}, ...]}; FOLDER/inputs.safetensors holds
each case's "{name}.param" (rows, cols), its gradients "{name}.grad{s}" for s = 0 .. steps - 1 and
"{name}.u", a matrix to orthogonalise alone. Writes FOLDER/torch.safetensors: "{name}.param" and
"{name}.momentum" after the steps, and "{name}.ns", Newton-Schulz of "{name}.u".

ns_dtype "bf16" is torch.optim.Muon as shipped (Newton-Schulz in bf16). For "f32" PyTorch's own
Newton-Schulz function is patched to skip its bf16 cast: its source with `grad.bfloat16()` replaced
by `grad.clone()` (a copy, as the cast made one), nothing else changed; the script refuses to run
if that text is not in it.
"""
import argparse
import inspect
import json
import os
import sys

import torch
import torch.optim._muon as muon_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_llama import read_safetensors, write_safetensors  # noqa: E402

SHIPPED_NS = muon_module._zeropower_via_newtonschulz


def f32_newton_schulz():
    source = inspect.getsource(SHIPPED_NS)
    cast = "grad.bfloat16()"
    if source.count(cast) != 1:
        sys.exit(f"torch_muon.py: PyTorch {torch.__version__}'s _zeropower_via_newtonschulz does not cast with "
                 f"'{cast}' once; the f32 patch does not apply")
    scope = {}
    exec(source.replace(cast, "grad.clone()"), muon_module.__dict__, scope)
    return scope["_zeropower_via_newtonschulz"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = json.load(open(os.path.join(args.folder, "config.json")))
    inputs = read_safetensors(os.path.join(args.folder, "inputs.safetensors"))
    patched = f32_newton_schulz()
    out = {}
    for case in cfg["cases"]:
        name = case["name"]
        # The module's global is what torch.optim.Muon's step calls.
        ns = SHIPPED_NS if case["ns_dtype"] == "bf16" else patched
        muon_module._zeropower_via_newtonschulz = ns
        coefficients = (muon_module.DEFAULT_A, muon_module.DEFAULT_B, muon_module.DEFAULT_C)
        out[f"{name}.ns"] = ns(inputs[f"{name}.u"], coefficients, case["ns_steps"], case["eps"]).float()
        param = torch.nn.Parameter(inputs[f"{name}.param"].clone())
        opt = torch.optim.Muon([param], lr=case["lr"], weight_decay=case["weight_decay"], momentum=case["momentum"],
                               nesterov=case["nesterov"], ns_steps=case["ns_steps"], eps=case["eps"],
                               adjust_lr_fn=case["adjust_lr_fn"])
        for s in range(case["steps"]):
            param.grad = inputs[f"{name}.grad{s}"].clone()
            opt.step()
        out[f"{name}.param"] = param.detach()
        out[f"{name}.momentum"] = opt.state[param]["momentum_buffer"]
    muon_module._zeropower_via_newtonschulz = SHIPPED_NS
    write_safetensors(os.path.join(args.folder, "torch.safetensors"), out)


if __name__ == "__main__":
    main()
