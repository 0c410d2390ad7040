#!/usr/bin/env python3
"""Data-parallel layouts of the 25M flavour at 1, 2 and 4 ranks under mpirun.

For each layout it trains a few steps on Shakespeare's train works (the config's
text dataset, data/shakespeare/train, byte tokenizer) and prints, from
rank 0's metrics.jsonl (steps after the first two, medians):
  step time, tokens/s per rank and in total, the data-parallel bytes each rank
  sent per step (measured by the communication layer) against the closed form,
  the share of communication time hidden behind compute, and the fullest rank's
  peak memory.

This machine has 2 cores: 2 and 4 ranks are oversubscribed (one OpenMP thread
each), so per-rank rates fall with the rank count; compare bytes and hidden
shares across layouts, not speed-ups. Run from the repository root after
scripts/setup.sh and scripts/prepare_data.sh:
    bench/distributed.py [--steps 8] [--flavor 25M]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

LAYOUTS = [
    ("single", 1, []),
    ("DDP 2", 2, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
    ("FSDP 2", 2, ["--parallelism.data_parallel_shard_degree", "2"]),
    ("DDP 4", 4, ["--parallelism.data_parallel_replicate_degree", "4", "--parallelism.data_parallel_shard_degree", "1"]),
    ("FSDP 4", 4, ["--parallelism.data_parallel_shard_degree", "4"]),
    ("HSDP 2x2", 4, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]),
    ("TP 2", 2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
    ("TP 4", 4, ["--parallelism.tensor_parallel_degree", "4", "--parallelism.data_parallel_shard_degree", "1"]),
    ("FSDP 2 x TP 2", 4, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]),
]


def run(name, ranks, flags, args, folder):
    dump = os.path.join(folder, name.replace(" ", "_"))
    cmd = ["build/anvil", "train", "configs/llama3_25m.toml", "--model.flavor", args.flavor,
           "--training.steps", str(args.steps), "--training.local_batch_size", str(args.local_batch),
           "--training.seq_len", str(args.seq_len), "--metrics.log_freq", "1", "--validation.enable", "false",
           "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
           "--profiling.enable_profiling", "false", "--job.dump_folder", dump] + flags
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if ranks > 1:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // ranks))
        cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(ranks)] + cmd
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{name} failed:\n{out.stdout}\n{out.stderr}")
    lines = [json.loads(l) for l in open(os.path.join(dump, "metrics.jsonl")) if '"loss"' in l]
    steady = lines[2:] or lines
    step_s = statistics.median(
        [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(lines[1:], lines[2:])] or [lines[-1]["elapsed_s"]])
    tps = statistics.median(l["tokens_per_s"] for l in steady)
    comm = statistics.median(l.get("comm_bytes_per_step", 0) for l in steady)
    closed = steady[-1].get("comm_bytes_closed_form", 0)
    hidden = statistics.median(l.get("comm_hidden_pct", 0) for l in steady)
    mem = max(l.get("max_active_bytes_max_over_ranks", l["max_active_bytes"]) for l in steady)
    tp = statistics.median(l.get("tp_comm_bytes_per_step", 0) for l in steady)
    return step_s, tps, comm, closed, hidden, mem, tp


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--flavor", default="25M")
    ap.add_argument("--local-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        print(f"llama3/{args.flavor}, bf16, {args.local_batch} x {args.seq_len} tokens per rank per step, "
              f"{args.steps} steps, medians after step 2; {os.cpu_count()} cores\n")
        print("| layout | ranks | step s | tok/s per rank | tok/s total | data-parallel bytes sent per rank per step | "
              "closed form | comm hidden | tensor-parallel bytes sent per rank per step | max peak memory per rank |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, ranks, flags in LAYOUTS:
            step_s, tps, comm, closed, hidden, mem, tp = run(name, ranks, flags, args, folder)
            dp = ranks > 1 and closed > 0
            comm_s = f"{comm / 2**20:.1f} MiB" if dp else "-"
            closed_s = f"{closed / 2**20:.1f} MiB" if dp else "-"
            hidden_s = f"{hidden:.0f}%" if dp else "-"
            tp_s = f"{tp / 2**20:.1f} MiB" if tp > 0 else "-"
            # tok/s per rank is per model replica's rank: under TP the replica's tokens are shared by its tp ranks.
            print(f"| {name} | {ranks} | {step_s:.3f} | {tps:.0f} | {tps * ranks:.0f} | {comm_s} | {closed_s} | "
                  f"{hidden_s} | {tp_s} | {mem / 2**20:.1f} MiB |", flush=True)


if __name__ == "__main__":
    main()
