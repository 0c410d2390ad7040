#!/usr/bin/env python3
"""Context parallelism's memory and balance, measured.

At a fixed number of tokens per rank the sequence grows with the cp degree:
llama3/25M, one sequence of --base x cp tokens per step, bf16, no activation
checkpointing, cp = 1, 2, 4, 8 (8 ranks oversubscribe this 2-core machine;
the ranks run one thread each, so every run has the same compute per token),
each cp > 1 under both rotate methods (allgather, ring) and both load
balancers (headtail, none). Every rank traces the last step; from each rank's
trace it sums the attention kernels' spans (cp.attention,
cp.attention_backward: the kernels and, for the ring, the merges, without the
transfers) and reports the busiest and idlest rank's time. From the metrics
log: the peak memory of the fullest rank, its activations' and its
communication buffers' peaks, and the last step's time and tokens/s per rank
(CP is FSDP over the cp ranks, so the weights, gradients and moments shrink
with cp; the activations are what stays flat). Prints a markdown table.

    bench/context_parallel.py [--base 2048] [--cps 1,2,4,8] [--steps 3]
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile


def run(args, cp, balancer, rotate, out):
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_MCA_mpi_yield_when_idle="1")
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["build/anvil", "train", "configs/llama3_25m.toml", "--training.seq_len", str(args.base * cp),
           "--training.local_batch_size", "1", "--training.global_batch_size", "1", "--training.steps",
           str(args.steps), "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
           "--profiling.enable_profiling", "true", "--profiling.profile_freq", str(args.steps),
           "--validation.enable", "false", "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
           "--job.dump_folder", out]
    if cp > 1:
        cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(cp)] + cmd + [
            "--parallelism.context_parallel_degree", str(cp), "--parallelism.context_parallel_load_balancer",
            balancer, "--parallelism.context_parallel_rotate_method", rotate]
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)}\n{r.stdout}")
    steps = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in line]
    last = steps[-1]
    peak_mib = max(last["peak_mib_by_rank"]) if cp > 1 else last["max_active_bytes"] / 2**20
    act_mib = (max(last["activation_peak_mib_by_rank"]) if cp > 1
               else last["max_active_bytes_by_category"]["activations"] / 2**20)
    comm_mib = (max(r["communication"] for r in last["max_active_bytes_by_rank_by_category"]) / 2**20 if cp > 1
                else last["max_active_bytes_by_category"]["communication"] / 2**20)
    attention = []
    for t in sorted(glob.glob(os.path.join(out, "profile_traces", f"step-{args.steps}*.trace.json"))):
        trace = json.load(open(t))
        attention.append(sum(e["dur"] for e in trace["traceEvents"]
                             if e.get("ph") == "X" and e.get("name") in ("cp.attention", "cp.attention_backward")))
    if cp > 1 and len(attention) != cp:
        sys.exit(f"expected {cp} traces of step {args.steps} in {out}/profile_traces")
    return {"peak_mib": peak_mib, "act_mib": act_mib, "comm_mib": comm_mib, "tokens_per_s": last["tokens_per_s"],
            "loss": [s["loss"] for s in steps],
            "attention_ms": [a / 1e3 for a in attention] if cp > 1 else []}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=int, default=2048, help="tokens per rank (the sequence is base x cp)")
    ap.add_argument("--cps", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if not os.access("build/anvil", os.X_OK):
        sys.exit("build first: scripts/test.sh or scripts/train.sh")
    subprocess.run(["scripts/prepare_data.sh"], check=True, stdout=subprocess.DEVNULL)
    print(f"\n## Context parallelism: llama3/25M, {args.base} tokens per rank, bf16, step {args.steps} of each run\n")
    print("| cp | seq_len | rotate | balancer | peak memory, fullest rank | its activations | its communication "
          "buffers | step time | tokens/s per rank | attention kernels, busiest rank | idlest rank "
          "| busiest / idlest |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cp in map(int, args.cps.split(",")):
        variants = ([(r, b) for r in ("allgather", "ring") for b in ("headtail", "none")] if cp > 1
                    else [("-", "-")])
        for rotate, balancer in variants:
            out = tempfile.mkdtemp(prefix="anvil_cp_")
            r = run(args, cp, balancer, rotate, out)
            a = r["attention_ms"]
            balance = (f"{max(a):.1f} ms | {min(a):.1f} ms | {max(a) / min(a):.2f}" if a else "- | - | -")
            print(f"| {cp} | {args.base * cp} | {rotate} | {balancer} | {r['peak_mib']:.1f} MiB "
                  f"| {r['act_mib']:.1f} MiB | {r['comm_mib']:.1f} MiB | {args.base / r['tokens_per_s']:.2f} s "
                  f"| {r['tokens_per_s']:.0f} | {balance} |", flush=True)
            subprocess.run(["rm", "-rf", out])


if __name__ == "__main__":
    main()
