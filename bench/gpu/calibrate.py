#!/usr/bin/env python3
"""Times, on this machine's GPU, the rates Anvil's GPU planner prices a run with,
and writes them as a calibration file (src/anvil/estimate/gpu_calibration.h).

    build/anvil calibrate CONFIG.toml --hardware h200 --gpus 1 --shapes shapes.json   # anywhere
    python3 bench/gpu/calibrate.py --shapes shapes.json --output calibration.json     # on the GPU
    build/anvil estimate CONFIG.toml --hardware h200 --gpus 1 --calibration calibration.json

It measures with PyTorch (any version with CUDA and scaled_dot_product_attention),
as the runs the planner models do, until Anvil's own CUDA kernels can:
  matmul_flops          the best bf16 GEMM rate over square sizes 4096, 8192, 16384 (FLOP/s)
  hbm_bandwidth         a 2 GiB device-to-device copy, bytes read + written per second
  host_seconds_per_op, host_seconds_per_launch, host_seconds_per_backward_node
                        eager PyTorch's host time for an op (a chain of views on a tensor that
                        requires grad), a kernel launch (a chain of multiplies, less the views) and an
                        autograd node (the views' backward)
  fsdp_hook_seconds, dtensor_optimizer_seconds_per_tensor, plain_optimizer_seconds_per_tensor,
  dtensor_op_seconds    FSDP2 over one rank on a model of tiny weights: a group's unshard or reduce,
                        fused AdamW per DTensor and per plain tensor, clipping per DTensor (CUDA only)
  kernel_seconds        the GPU's time per smallest kernel, back to back in a CUDA graph (for the
                        reader: the planner does not use it)
  gemms                 each (m, k, n) of the shapes file: torch.mm of bf16 (m x k) and (k x n), seconds
  attention             each shape: causal scaled_dot_product_attention, bf16, forward and backward seconds
Every time is the median of several runs after warm-up, by CUDA events.
--device cpu runs the same code on the CPU with small sizes: a check of this script, not a calibration.
"""
import argparse
import datetime
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_reference import sdpa  # this folder's: causal SDPA, written out on PyTorch before 2.0


def timed(fn, device, runs, warmup=3):
    """Median seconds of fn() over `runs` runs after `warmup`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def fsdp_host_costs(out, runs):
    """FSDP2's host costs on one rank, from a model of 16 blocks of nine 16 x 16 weights (a
    Llama block's parameter tensor count) whose kernels are negligible: one group's unshard or
    reduce, fused AdamW per DTensor and per plain tensor, clipping per DTensor."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(9))

        def forward(self, h):
            for lin in self.w:
                h = lin(h)
            return h

    def build(fsdp):
        model = nn.Sequential(*[Block() for _ in range(16)]).cuda()
        if fsdp:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for i, b in enumerate(model):
                fully_shard(b, mesh=mesh, mp_policy=mp, reshard_after_forward=i < 15)
            fully_shard(model, mesh=mesh, mp_policy=mp)
        return model

    inp = torch.randn(4, 16, device="cuda")

    def step_times(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        fb, clip, step = [], [], []
        for run in range(runs + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(inp).float().sum().backward()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            if run > 1:
                fb.append(t1 - t0)
                clip.append(t2 - t1)
                step.append(t3 - t2)
        return statistics.median(fb), statistics.median(clip), statistics.median(step)

    plain_fb, plain_clip, plain_step = step_times(build(False))
    fsdp_fb, fsdp_clip, fsdp_step = step_times(build(True))
    tensors = 16 * 9
    hooks = 17 + 15 + 17  # unshards in the forward (16 blocks, the root), again in the backward (all but the last block), reduces
    out["fsdp_hook_seconds"] = max(fsdp_fb - plain_fb, 1e-9) / hooks
    out["dtensor_optimizer_seconds_per_tensor"] = fsdp_step / tensors
    out["plain_optimizer_seconds_per_tensor"] = plain_step / tensors
    out["dtensor_op_seconds"] = fsdp_clip / tensors
    print(f"FSDP2 on one rank: {out['fsdp_hook_seconds'] * 1e3:.3f} ms a group's unshard or reduce; fused AdamW "
          f"{out['dtensor_optimizer_seconds_per_tensor'] * 1e6:.1f} us a DTensor, "
          f"{out['plain_optimizer_seconds_per_tensor'] * 1e6:.1f} us a plain tensor; clipping "
          f"{out['dtensor_op_seconds'] * 1e6:.1f} us a DTensor", flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", help="the shapes file of `anvil calibrate` (without it: the general rates only)")
    ap.add_argument("--output", required=True, help="the calibration file to write")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("calibrate.py: no CUDA GPU is visible to PyTorch (--device cpu checks the script only)")
    dt = torch.bfloat16
    shapes = {"gemms": [], "attention": []}
    if args.shapes:
        with open(args.shapes) as f:
            shapes = json.load(f)
    out = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (a check of calibrate.py, not a calibration)",
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }

    # The best square GEMM.
    best = 0.0
    for n in ([4096, 8192, 16384] if dev == "cuda" else [128, 256]):
        a, b = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)
        secs = timed(lambda: torch.mm(a, b), dev, args.runs)
        best = max(best, 2 * n**3 / secs)
        print(f"bf16 GEMM {n}^3: {2 * n**3 / secs / 1e12:.1f} TFLOP/s", flush=True)
        del a, b
    out["matmul_flops"] = best

    # A large copy: memory-bound kernels' bandwidth.
    numel = (1 << 30) if dev == "cuda" else (1 << 22)
    src = torch.empty(numel, device=dev, dtype=dt)
    dst = torch.empty_like(src)
    secs = timed(lambda: dst.copy_(src), dev, args.runs)
    out["hbm_bandwidth"] = 2 * src.numel() * src.element_size() / secs
    print(f"copy: {out['hbm_bandwidth'] / 1e9:.0f} GB/s (read + write)", flush=True)
    del src, dst

    # Eager PyTorch's host time (src/anvil/estimate/gpu_hardware.h's GpuSoftware names): chains of
    # 2000 small ops on a tensor that requires grad, whose kernels take less time than their
    # dispatch, so the wall time is the host's. Views launch nothing; a multiply launches a kernel.
    chain = 2000
    x = torch.randn(1024, device=dev, requires_grad=True)

    def chain_times(op):
        fwd, bwd = [], []
        for run in range(args.runs + 1):
            sync(dev)
            t0 = time.perf_counter()
            y = x
            for i in range(chain):
                y = op(y, i)
            sync(dev)
            t1 = time.perf_counter()
            y.sum().backward()
            sync(dev)
            t2 = time.perf_counter()
            if run > 0:  # the first warms up
                fwd.append((t1 - t0) / chain)
                bwd.append((t2 - t1) / chain)
        return statistics.median(fwd), statistics.median(bwd)

    view_fwd, view_bwd = chain_times(lambda y, i: y.view(32, 32) if i % 2 == 0 else y.view(1024))
    mul_fwd, _ = chain_times(lambda y, i: y * 1.0001)
    out["host_seconds_per_op"] = view_fwd
    out["host_seconds_per_launch"] = max(mul_fwd - view_fwd, 1e-9)
    out["host_seconds_per_backward_node"] = view_bwd
    print(f"eager host time: op {view_fwd * 1e6:.1f} us, launch {out['host_seconds_per_launch'] * 1e6:.1f} us, "
          f"backward node {view_bwd * 1e6:.1f} us", flush=True)
    if dev == "cuda":
        try:
            fsdp_host_costs(out, args.runs)
        except Exception as e:  # an older PyTorch without fully_shard: those stay the published figures
            print(f"FSDP2 host costs not measured ({type(e).__name__}: {e}); the planner keeps the published ones")

    # The smallest kernel's GPU time, launched back to back from a CUDA graph.
    if dev == "cuda":
        t = torch.zeros(1, device=dev)
        kernels = 1000
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for _ in range(3):
                t.add_(1)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(kernels):
                t.add_(1)
        out["kernel_seconds"] = timed(graph.replay, dev, args.runs) / kernels
        print(f"smallest kernel: {out['kernel_seconds'] * 1e6:.2f} us", flush=True)

    out["gemms"] = []
    for g in shapes.get("gemms", []):
        m, k, n = int(g["m"]), int(g["k"]), int(g["n"])
        a, b = torch.randn(m, k, device=dev, dtype=dt), torch.randn(k, n, device=dev, dtype=dt)
        secs = timed(lambda: torch.mm(a, b), dev, args.runs)
        out["gemms"].append({"m": m, "k": k, "n": n, "seconds": secs})
        print(f"GEMM {m} x {k} x {n}: {secs * 1e6:.1f} us, {2 * m * k * n / secs / 1e12:.1f} TFLOP/s", flush=True)
        del a, b

    out["attention"] = []
    for s in shapes.get("attention", []):
        b, h, q, kv, d = int(s["batch"]), int(s["heads"]), int(s["queries"]), int(s["keys"]), int(s["head_dim"])
        if q != kv:
            print(f"attention {s}: queries != keys is not timed (causal alignment differs); modelled", flush=True)
            continue
        qt, kt, vt = (torch.randn(b, h, q, d, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, q, d, device=dev, dtype=dt)
        fwd_s = timed(lambda: sdpa(qt, kt, vt), dev, args.runs)

        def both():
            o = sdpa(qt, kt, vt)
            o.backward(grad)

        both_s = timed(both, dev, args.runs)
        out["attention"].append({"batch": b, "queries": q, "keys": kv, "heads": h, "head_dim": d,
                                 "forward_seconds": fwd_s, "backward_seconds": max(both_s - fwd_s, 1e-9)})
        print(f"attention b{b} h{h} s{q} d{d}: forward {fwd_s * 1e3:.3f} ms, backward {(both_s - fwd_s) * 1e3:.3f} ms",
              flush=True)
        del qt, kt, vt, grad

    with open(args.output, "w") as f:
        json.dump(out, f, indent=2)
    print(f"calibrate.py: wrote {args.output}")


if __name__ == "__main__":
    main()
