#!/usr/bin/env python3
"""Holds one run of bench/gpu/check.sh --rehearse to its contract (gpu_check_rehearsal.sh runs it):
summary.json and every step's JSON (in steps.tar.gz) present and well formed, statuses from the
allowed set, the summary consistent with the steps and with the exit status, the summary table
printed last, at most 8 files in the output folder (what the device tool returns), and the
statuses EXPECT names.

    gpu_check_validate.py OUT_DIR EXIT_STATUS STDOUT_FILE good|truncated|missing-library
"""
import io
import json
import os
import sys
import tarfile

STEPS = ["00-unpack", "01-machine", "02-op-tests", "03-parity", "04-memory", "05-speed", "06-sanitizer",
         "07-calibration"]
ALLOWED = {"passed", "failed", "skipped", "timed_out", "not_built"}
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
    names = set(tar.getnames())
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
if expect == "good":
    check(rc == 0, f"exit {rc}")
    check(st["00-unpack"] == "passed", "unpack")
    check(st["01-machine"] == "passed" or (st["01-machine"] == "skipped" and by["01-machine"]["why"].startswith("no GPU")),
          f"machine: {by['01-machine']}")
    ops = by["02-op-tests"]
    check(st["02-op-tests"] == "passed" and ops["totals"]["tests"] > 0
          and all(b["exit_code"] == 0 and b["tests"] > 0 for b in ops["binaries"]), "op tests")
    for s in ("03-parity", "04-memory", "05-speed"):
        check(st[s] == "not_built" and by[s]["will_run"], f"{s}: {st[s]}, will_run {by[s].get('will_run')}")
    check(all(r["status"] == "passed" for r in by["05-speed"].get("pytorch_rows", [])), "PyTorch's CPU row")
    if st["01-machine"] == "skipped":  # no GPU: the sanitizer has nothing to run
        check(st["06-sanitizer"] == "skipped", "sanitizer")
    check(st["07-calibration"] in ("passed", "skipped") and len(by["07-calibration"]["estimates"]) >= 2, "calibration")
    check(summary["seconds"] < BUDGET / 2, f"{summary['seconds']} s: not well under the budget")
elif expect == "truncated":
    check(st["00-unpack"] == "failed" and "cannot unpack" in by["00-unpack"]["why"], f"unpack: {by['00-unpack']}")
    check(all(st[s] == "skipped" and by[s]["why"] == "the pack did not unpack" for s in STEPS[1:]), f"{st}")
elif expect == "missing-library":
    check(st["01-machine"] == "failed" and "libdnnl.so.2" in by["01-machine"]["why"], f"machine: {by['01-machine']}")
else:
    sys.exit(f"gpu_check_validate.py: unknown expectation {expect}")

if errors:
    print(f"gpu_check_validate.py {expect}: " + "; ".join(errors))
    sys.exit(1)
print(f"gpu_check_validate.py {expect}: as expected ({', '.join(f'{s} {st[s]}' for s in STEPS)})")
