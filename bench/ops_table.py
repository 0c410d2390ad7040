#!/usr/bin/env python3
"""Runs build/anvil_bench (or reads its saved output) and prints the kernel table
of docs/performance.md: each rate with its ratio to the bf16 GEMM and the memory
copy measured right after it, and the issue's target where there is one.

  bench/ops_table.py                 run every benchmark 3 times (about 15 minutes), print the medians
  bench/ops_table.py --from FILE     tabulate a saved console output of anvil_bench
"""
import argparse
import re
import subprocess
import sys

# (name pattern, ratio counter, target)
TARGETS = [
    (r"BM_Linear/bf16_.*", "vs_gemm", 0.80),
    (r"BM_Attention/bf16_fwd_bwd/T:2048/.*", "vs_gemm", 0.40),
    (r"BM_(RMSNorm|RoPE|SwiGLU|AdamW)/.*", "vs_copy", 0.50),
]


def parse(text):
    rows = []
    for line in text.splitlines():
        if not line.startswith("BM_"):
            continue
        name = line.split()[0].replace("/min_time:0.300", "")
        if "_mean" in name or "_stddev" in name or "_cv" in name:
            continue
        name = name.replace("_median", "")
        time = " ".join(line.split()[1:3])
        counters = dict(re.findall(r"(\S+)=([0-9.eE+-]+)", line))
        rows.append((name, time, {k: float(v) for k, v in counters.items()}))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="src", help="saved anvil_bench output")
    ap.add_argument("--filter", default="", help="passed to --benchmark_filter")
    args = ap.parse_args()
    if args.src:
        text = open(args.src).read()
    else:
        cmd = ["build/anvil_bench", "--benchmark_repetitions=3", "--benchmark_report_aggregates_only=true"]
        cmd += [f"--benchmark_filter={args.filter}"] if args.filter else []
        text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    for line in text.splitlines():
        if line.startswith(("threads:", "ceilings")):
            print(f"    {line}")
    print()
    print("Each row is the median of 3 repetitions; ratios are to the mean of the ceilings timed just before and after.")
    print()
    print("| kernel | time | TFLOP/s | GB/s | vs_gemm | vs_copy | GEMM ceiling TFLOP/s | copy ceiling GB/s | target | met |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    missed = 0
    for name, time, c in parse(text):
        target, met = "", ""
        for pat, key, goal in TARGETS:
            if re.fullmatch(pat, name):
                target = f"{key} ≥ {goal}"
                ok = c.get(key, 0) >= goal
                met = "yes" if ok else "**no**"
                missed += not ok
        fmt = lambda k, f: (f % c[k]) if k in c else ""
        print(f"| {name} | {time} | {fmt('TFLOP/s', '%.3f')} | {fmt('GB/s', '%.1f')} | {fmt('vs_gemm', '%.2f')} | "
              f"{fmt('vs_copy', '%.2f')} | {fmt('gemm_ceiling', '%.2f')} | {fmt('copy_ceiling', '%.1f')} | {target} | {met} |")
    print(f"\n{missed} targeted rows missed their target.")


if __name__ == "__main__":
    sys.exit(main())
