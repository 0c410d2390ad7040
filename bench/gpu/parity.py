#!/usr/bin/env python3
"""The comparisons behind bench/gpu/check.sh's parity, memory and speed steps, over the dump
folders of `anvil train` runs (metrics.jsonl, checkpoint/step-N/model.safetensors, op_times.md)
and the JSON of `anvil estimate --json`. Each comparison prints one line, writes its every figure
to --json as one object ("passed", "failures" and the figures), and exits 0 when it holds, 1 when
a bound fails (the line names the bound and by how much), 2 when an input is missing or unreadable.
--expect pass|BOUND makes it a self-test: exit 0 only when it passes, or fails on that bound.

    parity.py match REF RUN [--steps N] [--rel 1e-5] [--weights-rel 1e-5]
        each logged step's loss and grad_norm within --rel of REF's (|run - ref| / |ref|), the same
        steps logged (1..N with --steps), and the last checkpoint's weights within --weights-rel of
        REF's largest |weight| (max |run - ref| over every tensor / max |ref|)
    parity.py gap FP32_REF BF16_REF FP32_RUN BF16_RUN [--factor 2]
        RUN's bf16 loss gap at most --factor times REF's: the gap is the mean over the logged steps
        of |bf16 loss - fp32 loss|. The mean, not each step: a step's gap is the sum of a few
        roundings, which a different but as accurate order of sums (another device) may double at
        one step by chance; over the steps the typical gap shows
    parity.py memory ESTIMATE_JSON RUN [--source device|host] [--reserved-rel 0.02]
        each memory category's measured peak (the max over RUN's logged steps of
        max_active_bytes_by_category; with --source device, of the step's "device" object) equal to
        the estimate's ranks[0] by_category (ranks[0].device with --source device) to the byte, and
        the measured reserved peak within --reserved-rel of the estimate's peak_reserved_bytes
    parity.py estimate ESTIMATE_JSON
        the estimate's ranks[0].device (anvil estimate --job.device cuda) present, naming a CUDA
        device, with positive peak_bytes, peak_reserved_bytes and by_category figures
    parity.py speed RUN [--source device|host] [--skip 2] [--torch ROW_JSON] [--op-times-to DIR]
        the median tokens/s of the logged steps after the first --skip, the reserved and active
        peaks, op_times.md copied to DIR; with PyTorch's row (torch_reference.py's JSON line, as
        check.sh's pytorch_rows.jsonl holds it) the ratios Anvil / PyTorch of tokens/s and of
        reserved memory. It fails only when the run's figures are missing: speed has no bound here
    parity.py perturb SRC DST (--loss-rel R | --grad-norm-rel R) [--step K]
    parity.py perturb SRC DST (--weight-rel R | --add-bytes N --category C | --reserved-rel R) [--source S]
        DST: a copy of the dump folder SRC with one figure moved, for the check's self-test (a
        comparator that cannot fail proves nothing): every logged loss or grad_norm (or step K's)
        times 1 + R; one weight of the last checkpoint moved by R times the largest |weight|; N
        bytes added to category C's peak, or the reserved peak times 1 + R, at the last logged
        step (of its "device" object with --source device)

numpy is used when it imports (both the GPU machine's python3 and Debian's have it), else the
standard library's array module, slower but the same figures.
"""
import argparse
import json
import math
import os
import re
import shutil
import statistics
import struct
import sys
from array import array

try:
    import numpy as np
except ImportError:  # the array path below
    np = None


class Unusable(Exception):
    """An input that is missing or cannot be read: exit 2, not a failed bound."""


# ---- reading a dump folder ----

def logged_steps(run):
    """step -> the metrics.jsonl object of each training step (validation lines, which have
    validation_loss instead of loss, left out). A step logged twice (a resumed run) is refused:
    the check always starts from an empty folder."""
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        raise Unusable(f"{path}: no such file (the run did not start, or wrote elsewhere)")
    steps = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise Unusable(f"{path}:{n}: not JSON ({e})")
            if "loss" not in row:
                continue
            if row["step"] in steps:
                raise Unusable(f"{path}: step {row['step']} logged twice (a resumed run?)")
            steps[row["step"]] = row
    if not steps:
        raise Unusable(f"{path}: no training step logged")
    return steps


def last_checkpoint(run):
    """The newest complete step folder's model.safetensors (step-N.tmp and renamed aside ones left out)."""
    folder = os.path.join(run, "checkpoint")
    found = []
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            m = re.fullmatch(r"step-(\d+)", name)
            if m and os.path.exists(os.path.join(folder, name, "model.safetensors")):
                found.append((int(m.group(1)), name))
    if not found:
        raise Unusable(f"{folder}: no step-N/model.safetensors (was checkpoint.enable on?)")
    step, name = max(found)
    return name, os.path.join(folder, name, "model.safetensors")


def read_safetensors(path):
    """name -> (shape, values): the F32 and BF16 tensors of a safetensors file (8-byte little-endian
    header length, a JSON header of dtype, shape and data_offsets, then the data), as float32."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    base = 8 + n
    tensors = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        lo, hi = (base + o for o in t["data_offsets"])
        raw = data[lo:hi]
        if t["dtype"] == "F32":
            values = np.frombuffer(raw, dtype="<f4") if np else _array("f", raw)
        elif t["dtype"] == "BF16":  # the high half of a float32
            if np:
                values = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
            else:
                halves = _array("H", raw)
                values = _array("f", struct.pack(f"<{len(halves)}I", *(h << 16 for h in halves)))
        else:
            raise Unusable(f"{path}: {name} is {t['dtype']}; only F32 and BF16 are compared")
        tensors[name] = (tuple(t["shape"]), values)
    return tensors


def _array(code, raw):
    a = array(code)
    a.frombytes(raw)
    if sys.byteorder != "little":
        a.byteswap()
    return a


def max_abs(values):
    if np:
        return float(np.max(np.abs(values))) if len(values) else 0.0
    return max((abs(v) for v in values), default=0.0)


def max_abs_diff(a, b, limit):
    """(max |a - b|, its index, how many elements differ by more than limit); NaN counts as inf."""
    if np:
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
        d[np.isnan(d)] = math.inf
        if not len(d):
            return 0.0, 0, 0
        i = int(np.argmax(d))
        return float(d[i]), i, int(np.count_nonzero(d > limit))
    worst, at, over = 0.0, 0, 0
    for i, (x, y) in enumerate(zip(a, b)):
        d = abs(x - y)
        if d != d:
            d = math.inf
        if d > worst:
            worst, at = d, i
        over += d > limit
    return worst, at, over


def num(x):
    """A metrics figure as a float: nlohmann writes a NaN or an infinity as null."""
    return math.nan if x is None else float(x)


def rel_diff(run, ref):
    if not (math.isfinite(run) and math.isfinite(ref)):
        return math.inf
    if run == ref:
        return 0.0
    return abs(run - ref) / abs(ref) if ref else math.inf


# ---- the verdict ----

class Verdict:
    def __init__(self, check, name):
        self.d = {"check": check, "name": name, "passed": True, "failures": []}

    def __setitem__(self, k, v):
        self.d[k] = v

    def fail(self, bound, text, value=None, limit=None):
        """One bound that does not hold: which, by how much (value over limit) and one line."""
        f = {"bound": bound, "why": text}
        if value is not None:
            f["value"] = value
        if limit is not None:
            f["limit"] = limit
            if limit > 0 and value is not None and math.isfinite(value):
                f["times_the_bound"] = value / limit
                text += f" ({value / limit:.3g}x the bound)"
                f["why"] = text
        self.d["failures"].append(f)
        self.d["passed"] = False

    def finish(self, args, summary):
        self.d["summary"] = summary
        if not self.d["passed"]:
            self.d["why"] = "; ".join(f["why"] for f in self.d["failures"])
        line = f"{self.d['check']} {self.d['name']}: " + (
            f"passed: {summary}" if self.d["passed"] else f"FAILED: {self.d['why']}")
        rc = 0 if self.d["passed"] else 1
        if args.expect:  # a self-test: the verdict is as expected, or not
            bounds = [f["bound"] for f in self.d["failures"]]
            ok = self.d["passed"] if args.expect == "pass" else (not self.d["passed"] and args.expect in bounds)
            self.d.update(expect=args.expect, as_expected=ok)
            want = "pass" if args.expect == "pass" else f"fail on {args.expect}"
            line = f"self-test {self.d['name']}: {'as expected' if ok else 'NOT AS EXPECTED'} ({want}): " + line
            rc = 0 if ok else 1
        self.d["line"] = line
        if args.json:
            with open(args.json, "w") as f:
                json.dump(finite_json(self.d), f, indent=1, allow_nan=False)
        print(line)
        return rc


def finite_json(x):
    """x with each NaN or infinity as the string "nan", "inf" or "-inf": strict JSON has none."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: finite_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_json(v) for v in x]
    return x


def g(x):
    return f"{x:.3g}" if isinstance(x, float) else str(x)


# ---- the comparisons ----

def cmd_match(a):
    v = Verdict("match", a.name)
    v["ref"], v["run"] = a.ref, a.run
    v["bounds"] = {"loss_rel": a.rel, "grad_norm_rel": a.rel, "weights_rel": a.weights_rel}
    ref, run = logged_steps(a.ref), logged_steps(a.run)
    v["steps"] = sorted(run)
    want = sorted(ref) if a.steps is None else list(range(1, a.steps + 1))
    if sorted(ref) != want or sorted(run) != want:
        v.fail("steps", f"logged steps: reference {_span(ref)}, run {_span(run)}, expected {_span(want)}")
    common = sorted(set(ref) & set(run))
    for key in ("loss", "grad_norm"):
        worst, at = 0.0, None
        per_step = []
        for s in common:
            d = rel_diff(num(run[s].get(key)), num(ref[s].get(key)))
            per_step.append(d)
            if at is None or d > worst:
                worst, at = d, s
        v[f"max_{key}_rel_diff"], v[f"max_{key}_rel_diff_step"] = worst, at
        v[f"{key}_rel_diff_by_step"] = per_step
        if worst > a.rel:
            v.fail(key, f"{key} at step {at}: relative difference {worst:.3g} > {a.rel:g}"
                        f" (run {run[at][key]!r}, reference {ref[at][key]!r})", worst, a.rel)
    if a.weights_rel is not None:
        w = compare_weights(a.ref, a.run, a.weights_rel)
        v["weights"] = w
        for problem in w.pop("problems"):
            v.fail("weights", problem)
        if w.get("ratio") is not None and w["ratio"] > a.weights_rel:
            v.fail("weights", f"weights ({w['checkpoint']}): max |difference| {w['max_abs_diff']:.3g} in "
                              f"{w['worst_tensor']}[{w['worst_index']}] is {w['ratio']:.3g} of the largest "
                              f"|weight| {w['max_abs_weight']:.3g} > {a.weights_rel:g}; {w['elements_over']} "
                              f"element(s) over", w["ratio"], a.weights_rel)
    summary = (f"{len(common)} steps, loss {g(v.d['max_loss_rel_diff'])}, grad_norm "
               f"{g(v.d['max_grad_norm_rel_diff'])} relative (bound {a.rel:g})")
    if "weights" in v.d and v.d["weights"].get("ratio") is not None:
        summary += f", weights {g(v.d['weights']['ratio'])} of the largest (bound {a.weights_rel:g})"
    return v.finish(a, summary)


def compare_weights(ref_run, run_run, bound):
    ref_name, ref_path = last_checkpoint(ref_run)
    run_name, run_path = last_checkpoint(run_run)
    w = {"checkpoint": run_name, "problems": []}
    if ref_name != run_name:
        w["problems"].append(f"last checkpoints differ: reference {ref_name}, run {run_name}")
    ref, run = read_safetensors(ref_path), read_safetensors(run_path)
    if set(ref) != set(run):
        w["problems"].append(f"tensors differ: only in the reference {sorted(set(ref) - set(run))[:3]}, "
                             f"only in the run {sorted(set(run) - set(ref))[:3]}")
    names = sorted(set(ref) & set(run))
    w["tensors"] = len(names)
    biggest = max((max_abs(ref[n][1]) for n in names), default=0.0)
    if not (math.isfinite(biggest) and biggest > 0):
        w["problems"].append(f"the reference's largest |weight| is {biggest} (not a trained model)")
        return w
    worst, worst_name, worst_at, over, elements = 0.0, None, 0, 0, 0
    for n in names:
        (rs, rv), (ss, sv) = ref[n], run[n]
        if rs != ss:
            w["problems"].append(f"{n}: shape {list(ss)} against the reference's {list(rs)}")
            continue
        d, at, k = max_abs_diff(rv, sv, bound * biggest)
        elements += len(rv)
        over += k
        if worst_name is None or d > worst:
            worst, worst_name, worst_at = d, n, at
    w.update(elements=elements, max_abs_weight=biggest, max_abs_diff=worst, ratio=worst / biggest,
             worst_tensor=worst_name, worst_index=worst_at, elements_over=over)
    return w


def _span(steps):
    s = sorted(steps)
    if not s:
        return "none"
    return f"{s[0]}-{s[-1]} ({len(s)})" if s == list(range(s[0], s[-1] + 1)) else str(s)


def cmd_gap(a):
    v = Verdict("gap", a.name)
    v["runs"] = {"fp32_ref": a.fp32_ref, "bf16_ref": a.bf16_ref, "fp32_run": a.fp32_run, "bf16_run": a.bf16_run}
    v["bounds"] = {"factor": a.factor}
    runs = {k: logged_steps(p) for k, p in v.d["runs"].items()}
    steps = sorted(runs["fp32_ref"])
    if any(sorted(r) != steps for r in runs.values()):
        v.fail("steps", "logged steps differ: " + ", ".join(f"{k} {_span(r)}" for k, r in runs.items()))
    steps = sorted(set.intersection(*(set(r) for r in runs.values())))
    if not steps:
        v.fail("steps", "no step logged by all four runs")
        return v.finish(a, "")
    loss = lambda k, s: num(runs[k][s]["loss"])
    ref_gaps = [abs(loss("bf16_ref", s) - loss("fp32_ref", s)) for s in steps]
    run_gaps = [abs(loss("bf16_run", s) - loss("fp32_run", s)) for s in steps]
    ref_gap, run_gap = statistics.fmean(ref_gaps), statistics.fmean(run_gaps)
    v.d.update(steps=steps, ref_gap_by_step=ref_gaps, run_gap_by_step=run_gaps, ref_mean_gap=ref_gap,
               run_mean_gap=run_gap, ratio=run_gap / ref_gap if ref_gap else (0.0 if run_gap == 0 else math.inf))
    if not (math.isfinite(ref_gap) and math.isfinite(run_gap)):
        v.fail("gap", f"a loss is not finite (mean gaps: run {run_gap}, reference {ref_gap})")
    elif run_gap > a.factor * ref_gap:
        v.fail("gap", f"the run's mean bf16 loss gap {run_gap:.3g} > {a.factor:g} x the reference's {ref_gap:.3g}",
               run_gap, a.factor * ref_gap)
    return v.finish(a, f"mean |bf16 - fp32| loss over {len(steps)} steps: {run_gap:.3g} against the reference's "
                       f"{ref_gap:.3g} (ratio {g(v.d['ratio'])}, bound {a.factor:g})")


def read_estimate(path):
    """`anvil estimate --json`'s object; the lines anvil may print before it (a warning) are skipped."""
    try:
        text = open(path).read()
    except OSError as e:
        raise Unusable(f"{path}: {e.strerror}")
    start = text.find("{")
    while start >= 0:
        try:
            return json.JSONDecoder().raw_decode(text, start)[0]
        except ValueError:
            start = text.find("\n{", start + 1)
            start = start + 1 if start >= 0 else -1
    last = [l for l in text.splitlines() if l.strip()][-1:] or ["no output"]
    raise Unusable(f"{path}: no JSON object in anvil estimate's output ({last[0][:200]})")


def estimate_rank(est, source, path):
    ranks = est.get("ranks") or [{}]
    r = ranks[0]
    if source == "device":
        if "device" not in r:
            raise Unusable(f"{path}: ranks[0] has no \"device\" object (an anvil estimate without --job.device cuda, "
                           f"or one from before the GPU dry run); it has {sorted(r)}")
        r = r["device"]
    missing = [k for k in ("peak_bytes", "peak_reserved_bytes", "by_category") if k not in r]
    if missing:
        raise Unusable(f"{path}: ranks[0]{'.device' if source == 'device' else ''} lacks {', '.join(missing)}")
    return r


def measured(row, source, step, path):
    if source == "host":
        return row
    if not isinstance(row.get("device"), dict):
        raise Unusable(f"{path}: step {step} has no \"device\" object (not a GPU run, or a build before it)")
    return row["device"]


def cmd_estimate(a):
    v = Verdict("estimate", a.name)
    est = read_estimate(a.estimate)
    d = estimate_rank(est, "device", a.estimate)
    v.d.update(device=d.get("name"), peak_bytes=d["peak_bytes"], peak_reserved_bytes=d["peak_reserved_bytes"],
               by_category=d["by_category"], host_peak_bytes=(est.get("ranks") or [{}])[0].get("peak_bytes"))
    if not str(d.get("name", "")).startswith("cuda"):
        v.fail("device", f"ranks[0].device.name is {d.get('name')!r}, not a CUDA device")
    for k in ("peak_bytes", "peak_reserved_bytes"):
        if not (isinstance(d[k], (int, float)) and d[k] > 0):
            v.fail(k, f"ranks[0].device.{k} is {d[k]!r}, not positive")
    if d["peak_reserved_bytes"] < d["peak_bytes"]:
        v.fail("reserved", f"reserved {d['peak_reserved_bytes']} below allocated {d['peak_bytes']}")
    cats = d["by_category"]
    for c in ("parameters", "gradients", "optimizer_state", "activations"):
        if not (isinstance(cats.get(c), (int, float)) and cats[c] > 0):
            v.fail("by_category", f"ranks[0].device.by_category.{c} is {cats.get(c)!r}, not positive")
    return v.finish(a, f"{d.get('name')}: peak {d['peak_bytes'] / 2**30:.2f} GiB, reserved "
                       f"{d['peak_reserved_bytes'] / 2**30:.2f} GiB, " +
                    ", ".join(f"{c} {b / 2**30:.2f}" for c, b in cats.items() if b) + " GiB")


def cmd_memory(a):
    v = Verdict("memory", a.name)
    v.d.update(estimate=a.estimate, run=a.run, source=a.source, bounds={"category_bytes": 0, "reserved_rel": a.reserved_rel})
    est = estimate_rank(read_estimate(a.estimate), a.source, a.estimate)
    steps = logged_steps(a.run)
    rows = {s: measured(r, a.source, s, a.run) for s, r in sorted(steps.items())}
    cats = list(est["by_category"])
    for r in rows.values():
        cats += [c for c in r.get("max_active_bytes_by_category", {}) if c not in cats]
    table = {}
    for c in cats:
        m = max(int(r.get("max_active_bytes_by_category", {}).get(c, 0)) for r in rows.values())
        e = int(est["by_category"].get(c, 0))
        table[c] = {"estimate": e, "measured": m, "difference": m - e}
        if m != e:
            v.fail("category", f"{c}: measured peak {m:,} bytes, estimated {e:,} ({m - e:+,})", float(abs(m - e)), 0)
    reserved = max(int(r["max_reserved_bytes"]) for r in rows.values())
    active = max(int(r["max_active_bytes"]) for r in rows.values())
    rel = abs(reserved - est["peak_reserved_bytes"]) / est["peak_reserved_bytes"] if est["peak_reserved_bytes"] else math.inf
    v.d.update(steps=sorted(rows), by_category=table, measured_reserved_bytes=reserved,
               estimate_reserved_bytes=est["peak_reserved_bytes"], reserved_rel_diff=rel,
               # Recorded, not held: the brief of this step is the categories and the reserved bytes.
               measured_peak_bytes=active, estimate_peak_bytes=est["peak_bytes"])
    if rel > a.reserved_rel:
        v.fail("reserved", f"reserved: measured {reserved / 2**30:.3f} GiB, estimated "
                           f"{est['peak_reserved_bytes'] / 2**30:.3f} GiB, {rel:.3g} apart > {a.reserved_rel:g}",
               rel, a.reserved_rel)
    off = [c for c, t in table.items() if t["difference"]]
    return v.finish(a, f"{len(cats) - len(off)} of {len(cats)} categories equal to the byte over {len(rows)} steps; "
                       f"reserved {reserved / 2**30:.3f} GiB against {est['peak_reserved_bytes'] / 2**30:.3f} "
                       f"({rel:.2%} apart, bound {a.reserved_rel:.0%})")


def cmd_speed(a):
    v = Verdict("speed", a.name)
    v.d.update(run=a.run, source=a.source, skip=a.skip)
    steps = logged_steps(a.run)
    rows = {s: measured(r, a.source, s, a.run) for s, r in sorted(steps.items())}
    timed = [s for s in sorted(steps) if s > a.skip]
    if not timed:
        v.fail("steps", f"no logged step after the first {a.skip} (logged {_span(steps)})")
        return v.finish(a, "")
    tps = statistics.median(num(steps[s].get("tokens_per_s")) for s in timed)
    reserved = max(int(r["max_reserved_bytes"]) for r in rows.values())
    v.d.update(timed_steps=timed, tokens_per_s=tps, tokens_per_s_by_step=[steps[s]["tokens_per_s"] for s in sorted(steps)],
               max_reserved_bytes=reserved, max_active_bytes=max(int(r["max_active_bytes"]) for r in rows.values()),
               mfu_pct=statistics.median(num(steps[s].get("mfu_pct")) for s in timed))
    if not (math.isfinite(tps) and tps > 0):
        v.fail("tokens_per_s", f"median tokens/s {tps}")
    if a.op_times_to:
        src = os.path.join(a.run, "op_times.md")
        if os.path.exists(src):
            os.makedirs(a.op_times_to, exist_ok=True)
            dst = os.path.join(a.op_times_to, "op_times-" + re.sub(r"[^A-Za-z0-9._-]+", "-", a.name).strip("-") + ".md")
            shutil.copyfile(src, dst)
            v["op_times"] = os.path.relpath(dst, os.path.dirname(os.path.abspath(a.op_times_to)))
        else:
            v.fail("op_times", f"{src}: no such file (profiling.op_times off?)")
    summary = f"{tps:,.0f} tok/s, reserved {reserved / 2**30:.2f} GiB"
    if a.torch:
        t = json.loads(a.torch)
        v["torch"] = t
        if t.get("status", "passed") == "passed" and t.get("tokens_per_s"):
            v["tokens_per_s_ratio"] = tps / t["tokens_per_s"]
            summary += f"; x{v.d['tokens_per_s_ratio']:.2f} PyTorch's tok/s"
        if t.get("max_reserved_gib"):
            v["reserved_ratio"] = reserved / (t["max_reserved_gib"] * 2**30)
            summary += f", x{v.d['reserved_ratio']:.2f} its reserved"
    return v.finish(a, summary)


# ---- the self-test's perturbations ----

def cmd_perturb(a):
    if os.path.exists(a.dst):
        shutil.rmtree(a.dst)
    shutil.copytree(a.src, a.dst)
    steps = logged_steps(a.dst)
    if a.weight_rel is None:
        path = os.path.join(a.dst, "metrics.jsonl")
        lines = open(path).read().splitlines()
        last = max(steps)
        changed = 0
        for i, line in enumerate(lines):
            row = json.loads(line) if line.strip() else {}
            if "loss" not in row:
                continue
            mem = row["device"] if a.source == "device" else row
            if a.loss_rel is not None and a.step in (None, row["step"]):
                row["loss"] *= 1 + a.loss_rel
            elif a.grad_norm_rel is not None and a.step in (None, row["step"]):
                row["grad_norm"] *= 1 + a.grad_norm_rel
            elif a.add_bytes is not None and row["step"] == last:
                mem["max_active_bytes_by_category"][a.category] += a.add_bytes
            elif a.reserved_rel is not None and row["step"] == last:
                mem["max_reserved_bytes"] = int(mem["max_reserved_bytes"] * (1 + a.reserved_rel))
            else:
                continue
            changed += 1
            lines[i] = json.dumps(row)
        if not changed:
            raise Unusable(f"{path}: no line to perturb (step {a.step})")
        open(path, "w").write("\n".join(lines) + "\n")
        at = "every step" if a.step is None else f"step {a.step}"
        what = (f"loss x (1 + {a.loss_rel:g}) at {at}" if a.loss_rel is not None else
                f"grad_norm x (1 + {a.grad_norm_rel:g}) at {at}" if a.grad_norm_rel is not None else
                f"{a.source} {a.category} + {a.add_bytes} bytes at step {last}" if a.add_bytes is not None else
                f"{a.source} reserved x (1 + {a.reserved_rel:g}) at step {last}")
    else:
        name, path = last_checkpoint(a.dst)
        tensors = read_safetensors(path)
        biggest = max(max_abs(v) for _, v in tensors.values())
        data = bytearray(open(path, "rb").read())
        (n,) = struct.unpack_from("<Q", data, 0)
        header = json.loads(data[8:8 + n])
        # One element of the first F32 tensor in the file (of the largest |weight|'s scale, so
        # that the change is exactly R of it), moved in place.
        tname = min((k for k, t in header.items() if k != "__metadata__" and t["dtype"] == "F32"),
                    key=lambda k: header[k]["data_offsets"][0])
        at = 8 + n + header[tname]["data_offsets"][0]
        (x,) = struct.unpack_from("<f", data, at)
        struct.pack_into("<f", data, at, x + a.weight_rel * biggest)
        open(path, "wb").write(data)
        what = f"{name}: {tname}[0] + {a.weight_rel:g} x the largest |weight| {biggest:.3g}"
    print(f"perturb: {a.dst}: {what}")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def cmd(name, fn):
        s = sub.add_parser(name)
        s.set_defaults(fn=fn)
        if name != "perturb":
            s.add_argument("--name", default=name, help="the comparison's name in its line and JSON")
            s.add_argument("--json", help="write the verdict, with every figure, here")
            s.add_argument("--expect", help="a self-test: exit 0 only when the comparison passes (pass) or "
                                            "fails on this bound (loss, grad_norm, weights, gap, category, ...)")
        return s

    s = cmd("match", cmd_match)
    s.add_argument("ref")
    s.add_argument("run")
    s.add_argument("--steps", type=int, help="the steps 1..N both must have logged")
    s.add_argument("--rel", type=float, default=1e-5)
    s.add_argument("--weights-rel", type=float, default=1e-5)
    s.add_argument("--no-weights", dest="weights_rel", action="store_const", const=None)
    s = cmd("gap", cmd_gap)
    for k in ("fp32_ref", "bf16_ref", "fp32_run", "bf16_run"):
        s.add_argument(k)
    s.add_argument("--factor", type=float, default=2.0)
    s = cmd("memory", cmd_memory)
    s.add_argument("estimate")
    s.add_argument("run")
    s.add_argument("--source", choices=("device", "host"), default="device")
    s.add_argument("--reserved-rel", type=float, default=0.02)
    s = cmd("estimate", cmd_estimate)
    s.add_argument("estimate")
    s = cmd("speed", cmd_speed)
    s.add_argument("run")
    s.add_argument("--source", choices=("device", "host"), default="device")
    s.add_argument("--skip", type=int, default=2)
    s.add_argument("--torch", help="PyTorch's row: one JSON object")
    s.add_argument("--op-times-to", help="copy the run's op_times.md into this folder")
    s = cmd("perturb", cmd_perturb)
    s.add_argument("src")
    s.add_argument("dst")
    how = s.add_mutually_exclusive_group(required=True)
    how.add_argument("--loss-rel", type=float)
    how.add_argument("--grad-norm-rel", type=float)
    how.add_argument("--weight-rel", type=float)
    how.add_argument("--add-bytes", type=int)
    how.add_argument("--reserved-rel", type=float)
    s.add_argument("--step", type=int)
    s.add_argument("--category", default="activations")
    s.add_argument("--source", choices=("device", "host"), default="host")

    a = p.parse_args()
    try:
        return a.fn(a)
    except (Unusable, OSError, KeyError, ValueError, TypeError) as e:
        what = e if isinstance(e, Unusable) else f"{type(e).__name__}: {e}"
        line = f"{a.cmd} {getattr(a, 'name', '')}: UNUSABLE INPUT: {what}"
        if getattr(a, "expect", None):
            line = f"self-test {a.name}: NOT AS EXPECTED: " + line
        if getattr(a, "json", None):
            d = {"check": a.cmd, "name": a.name, "passed": False, "unusable": True,
                 "failures": [{"bound": "input", "why": str(what)}], "why": str(what), "line": line}
            if a.expect:
                d.update(expect=a.expect, as_expected=False)
            with open(a.json, "w") as f:
                json.dump(d, f, indent=1)
        print(line)
        return 2


if __name__ == "__main__":
    sys.exit(main())
