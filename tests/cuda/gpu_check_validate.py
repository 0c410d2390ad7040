#!/usr/bin/env python3
"""Holds one run of bench/gpu/check.sh --rehearse to its contract (gpu_check_rehearsal.sh runs it):
summary.json and every step's JSON (in steps.tar.gz) present and well formed, statuses from the
allowed set, the summary consistent with the steps and with the exit status, the summary table
printed last, at most 8 files in the output folder (what the device tool returns), and the
statuses EXPECT names.

With EXPECT good, the parity, memory and speed steps are "skipped" (no GPU: their --job.device
cuda runs skipped), and their facts show what ran without a GPU and that it passed: every GPU run
they will make listed with its command, the CPU halves of the debug model's parity runs, the dry
run of the GPU path with its device figures, a CPU stand-in of a speed row, and the comparator's
self-test: passing where it must, and failing on the very bound each perturbed copy moves.

    gpu_check_validate.py OUT_DIR EXIT_STATUS STDOUT_FILE good|truncated|missing-library
"""
import io
import json
import os
import sys
import tarfile

STEPS = ["00-unpack", "01-machine", "02-op-tests", "03-parity", "04-memory", "05-speed", "06-sanitizer",
         "07-calibration"]
ALLOWED = {"passed", "failed", "skipped", "timed_out"}
BUDGET = 360

out, rc, stdout_file, expect = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
errors = []


def check(cond, what):
    if not cond:
        errors.append(what)
    return cond


summary = json.load(open(os.path.join(out, "summary.json")))
files = sorted(os.listdir(out))
check(len(files) <= 8 and {"summary.json", "summary.md", "check.log", "steps.tar.gz"} <= set(files),
      f"the output folder holds {files}")
check(summary["mode"] == "rehearsal", f"mode {summary['mode']}")
check(summary["exit_code"] == rc, f"summary.json says exit {summary['exit_code']}, check.sh exited {rc}")
check(summary["seconds"] < BUDGET, f"{summary['seconds']} s, over the {BUDGET} s budget")
rows = summary["steps"]
check([r["step"] for r in rows] == STEPS, f"steps {[r['step'] for r in rows]}")
bad = [r["step"] for r in rows if r["status"] in ("failed", "timed_out")]
check(summary["failed_steps"] == bad and summary["result"] == ("failed" if bad else "passed")
      and rc == (1 if bad else 0), f"result {summary['result']} / exit {rc} / failed steps {bad}")
check(summary["counts"] == {s: sum(r["status"] == s for r in rows) for s in ALLOWED}, "counts")
check(summary["malformed_steps"] == [], f"malformed step JSON: {summary['malformed_steps']}")

with tarfile.open(os.path.join(out, "steps.tar.gz")) as tar:
    names = {n.removeprefix("./") for n in tar.getnames()}
    for row in rows:
        s = row["step"]
        if not check(f"{s}.json" in names and f"{s}.log" in names, f"{s}: .json or .log not in steps.tar.gz"):
            continue
        d = json.load(io.TextIOWrapper(tar.extractfile(f"{s}.json")))
        check(d == row, f"{s}: its JSON differs from summary.json's")
        check(d["step"] == s and d["status"] in ALLOWED, f"{s}: step {d['step']!r}, status {d['status']!r}")
        check(isinstance(d["exit_code"], int) and isinstance(d["limit_seconds"], int)
              and isinstance(d["seconds"], (int, float)) and d["seconds"] <= d["limit_seconds"] + 6,
              f"{s}: exit_code/seconds/limit_seconds {d['exit_code']!r} {d['seconds']!r} {d['limit_seconds']!r}")
        check(isinstance(d["why"], str) and (d["why"] == "") == (d["status"] == "passed"), f"{s}: why {d['why']!r}")

table = open(os.path.join(out, "summary.md")).read()
check(open(stdout_file).read().endswith(table), "the summary table is not the last thing printed")

by = {r["step"]: r for r in rows}
st = {s: by[s]["status"] for s in STEPS}

# The GPU runs each step will make (runs.tsv's names), and the flags that make them what they are.
GPU_RUNS = {
    "03-parity": {"debugmodel-fp32-cuda": ["--training.mixed_precision_param float32", "--checkpoint.enable"],
                  "debugmodel-bf16-cuda": ["--training.mixed_precision_param bfloat16"],
                  "llama3_25m-fp32-cuda": ["--training.mixed_precision_param float32", "--activation_checkpoint.mode none"],
                  "llama3_25m-bf16-cuda": ["--training.mixed_precision_param bfloat16"],
                  "llama3_25m-ac-selective-op": ["--activation_checkpoint.mode selective",
                                                 "--activation_checkpoint.selective_ac_option op"],
                  "llama3_25m-ac-selective-2": ["--activation_checkpoint.mode selective",
                                                "--activation_checkpoint.selective_ac_option 2"],
                  "llama3_25m-ac-full": ["--activation_checkpoint.mode full"],
                  "llama3_25m-accum2": ["--training.local_batch_size 4 --training.global_batch_size 8"]},
    "04-memory": {"1b": ["configs/llama3_1b.toml", "--training.seq_len 8192", "--training.local_batch_size 1",
                         "--activation_checkpoint.mode none"]},
    "05-speed": {"anvil-1B-b1-none": ["--profiling.op_times"], "anvil-1B-b4-full": ["--activation_checkpoint.mode full"],
                 "anvil-8B-b1-full": ["configs/llama3_8b.toml"]},
}
# What runs without a GPU and must pass; the self-tests' expectations (pass, or the bound to fail on).
CPU_RUNS = {"03-parity": {"debugmodel-fp32-cpu", "debugmodel-bf16-cpu", "debugmodel-fp32-cpu-again"},
            "04-memory": {"1b-estimate", "debugmodel-cpu-estimate", "debugmodel-cpu"},
            "05-speed": {"anvil-rehearsal"}}
SELF_TESTS = {"03-parity": ["pass", "pass", "loss", "grad_norm", "weights", "gap"],
              "04-memory": ["pass", "category", "reserved"], "05-speed": []}


def anvil_steps(s, d, tar_names):
    """A parity, memory or speed step of a rehearsal: skipped for its GPU runs alone, its other parts passed."""
    check(d["status"] == "skipped" and d["why"].startswith("no GPU"), f"{s}: {d['status']}: {d['why']}")
    runs = {r["name"]: r for r in d.get("runs", [])}
    for name, flags in GPU_RUNS[s].items():
        r = runs.get(name)
        if check(r is not None, f"{s}: no GPU run {name} listed"):
            check(r["device"] == "cuda" and r["status"] == "skipped" and r["why"] == "no GPU"
                  and "--job.device cuda" in r["command"] and all(f in r["command"] for f in flags),
                  f"{s}: {name}: {r}")
            check("fsdp_single_rank" not in r["command"], f"{s}: {name} runs with fsdp_single_rank")
    for name in CPU_RUNS[s]:
        check(runs.get(name, {}).get("status") == "passed", f"{s}: {name}: {runs.get(name)}")
    check(all(r["status"] in ("passed", "skipped") for r in runs.values()),
          f"{s}: runs {[(n, r['status']) for n, r in runs.items() if r['status'] not in ('passed', 'skipped')]}")
    # Not made (a GPU run skipped), or made and passed: a made comparison that failed fails the step.
    for c in d.get("comparisons", []):
        check(c.get("made") is False or c.get("passed") is True, f"{s}: comparison {c.get('line')}")
    tests = d.get("self_test", [])
    check(sorted(t.get("expect") for t in tests) == sorted(SELF_TESTS[s]),
          f"{s}: self-tests {[t.get('expect') for t in tests]}, expected {SELF_TESTS[s]}")
    for t in tests:
        bounds = [f["bound"] for f in t.get("failures", [])]
        right = t.get("passed") is True if t.get("expect") == "pass" else (t.get("passed") is False and t.get("expect") in bounds)
        check(t.get("as_expected") is True and right and not t.get("unusable"), f"{s}: {t.get('line')}")
    if s == "04-memory":
        est = [c for c in d.get("comparisons", []) if c.get("check") == "estimate"]
        check(len(est) == 1 and est[0].get("passed") and str(est[0].get("device")).startswith("cuda")
              and est[0]["peak_bytes"] > 0 and est[0]["peak_reserved_bytes"] >= est[0]["peak_bytes"]
              and all(est[0]["by_category"][c] > 0 for c in ("parameters", "gradients", "optimizer_state", "activations")),
              f"04-memory: the GPU dry run's figures: {est}")
    if s == "05-speed":
        row = [c for c in d.get("comparisons", []) if c.get("made", True)]
        ok = check(len(row) == 1 and row[0].get("passed") and row[0]["tokens_per_s"] > 0 and row[0]["max_reserved_bytes"] > 0,
                   f"05-speed: the CPU stand-in row: {row}")
        if ok:
            check(f"05-speed/{os.path.basename(row[0].get('op_times', ''))}" in tar_names, "05-speed: its op table")
            if d.get("pytorch_rows"):
                check(row[0].get("tokens_per_s_ratio", 0) > 0, "05-speed: no Anvil/PyTorch tokens/s ratio")

if expect == "good":
    check(rc == 0, f"exit {rc}")
    check(st["00-unpack"] == "passed", "unpack")
    check(st["01-machine"] == "passed" or (st["01-machine"] == "skipped" and by["01-machine"]["why"].startswith("no GPU")),
          f"machine: {by['01-machine']}")
    ops = by["02-op-tests"]
    check(st["02-op-tests"] == "passed" and ops["totals"]["tests"] > 0
          and all(b["exit_code"] == 0 and b["tests"] > 0 for b in ops["binaries"]), "op tests")
    for s in ("03-parity", "04-memory", "05-speed"):
        anvil_steps(s, by[s], names)
    check(all(r["status"] == "passed" for r in by["05-speed"].get("pytorch_rows", [])), "PyTorch's CPU row")
    if st["01-machine"] == "skipped":  # no GPU: the sanitizer has nothing to run
        check(st["06-sanitizer"] == "skipped", "sanitizer")
    check(st["07-calibration"] in ("passed", "skipped") and len(by["07-calibration"]["estimates"]) >= 2, "calibration")
    check(summary["seconds"] < BUDGET / 2, f"{summary['seconds']} s: not well under the budget")
elif expect == "truncated":
    check(st["00-unpack"] == "failed" and "cannot unpack" in by["00-unpack"]["why"], f"unpack: {by['00-unpack']}")
    check(all(st[s] == "skipped" and by[s]["why"] == "the pack did not unpack" for s in STEPS[1:]), f"{st}")
elif expect == "missing-library":  # run with --only 01
    check(st["01-machine"] == "failed" and "libdnnl.so.2" in by["01-machine"]["why"], f"machine: {by['01-machine']}")
    check(all(st[s] == "skipped" and by[s]["why"].startswith("not asked for (--only") for s in STEPS[2:]), f"{st}")
else:
    sys.exit(f"gpu_check_validate.py: unknown expectation {expect}")

if errors:
    print(f"gpu_check_validate.py {expect}: " + "; ".join(errors))
    sys.exit(1)
print(f"gpu_check_validate.py {expect}: as expected ({', '.join(f'{s} {st[s]}' for s in STEPS)})")
