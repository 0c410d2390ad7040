#!/usr/bin/env python3
"""Pipeline bubbles measured from every rank's trace, beside the closed forms.

For each schedule at P = 2 and 4 ranks and m = 4, 8 and 16 micro-batches it
trains a few steps of llama3/25M (micro-batches of one sequence) with
profiling on, reads the traces every pp rank writes of the last step, and per
rank measures
    bubble = 1 - busy / pass,   busy = its action spans (pipeline.1F3, ...)
                                       minus the receive waits inside them
                                pass = from the first rank's pipeline.pass
                                       start to the last one's end It prints a markdown table of
the mean over ranks and the worst rank beside the closed form ((P-1)/(m+P-1)
for GPipe and 1F1B, (P-1)/(V*m+P-1) for Interleaved1F1B with V = 2 stages per
rank), the same program's bubble in Anvil's unit-cost simulation (F = I = W =
1, B = 2; `anvil pipeline-schedule` prints it) — both assume equal stages — and
the program the ranks ran (read from their traces; ZBVZeroBubble's is planned
with the stages' estimated costs) simulated with this run's measured action
times (what the
schedule gives these unequal stages with instant messages; the last column says
how unequal the ranks' work was, busiest over idlest), and writes one SVG per schedule (P = 4,
m = 8): every rank's F/B/I/W actions, its receive waits and a line per message
between ranks on one timeline, the ranks' traces laid on rank 0's clock (their
clock_origin_us, which carries each host's measured offset); --trace-dir writes each run's ranks as one Chrome
trace (chrome://tracing, Perfetto) with a flow arrow per message.

This machine has 2 cores: each rank runs one OpenMP thread, so P = 2 is two
ranks on two cores but P = 4 is four ranks on two cores, and ranks that could
run at once take turns; the P = 4 rows measure more than the schedule.
Run from the repository root after scripts/setup.sh:
    bench/pipeline_bubbles.py [--steps 2] [--seq 256] [--svg-dir docs/img] [--auto-split]
                              [--schedules 1F1B,...] [--ranks 2,4] [--micro-batches 4,8,16]
"""
import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"]
ACTION = re.compile(r"^pipeline\.(\d+)([FBIW])(\d+)$")
COLOURS = {"F": "#4c78a8", "B": "#54a24b", "I": "#72b7b2", "W": "#eeca3b", "wait": "#e45756"}


def closed_form(schedule, P, m, V=2):
    if schedule in ("GPipe", "1F1B"):
        return (P - 1) / (m + P - 1)
    if schedule == "Interleaved1F1B":
        return (P - 1) / (V * m + P - 1)
    return None


def run(args, schedule, P, m, out):
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_MCA_mpi_yield_when_idle="1")
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["mpirun", "--oversubscribe", "-np", str(P), "build/anvil", "train", "configs/llama3_25m.toml",
           "--training.seq_len", str(args.seq), "--training.local_batch_size", str(m),
           "--training.global_batch_size", str(m), "--parallelism.pipeline_parallel_degree", str(P),
           "--parallelism.pipeline_parallel_schedule", schedule, "--parallelism.pipeline_parallel_microbatch_size", "1",
           "--training.steps", str(args.steps), "--profiling.enable_profiling", "true",
           "--profiling.profile_freq", str(args.steps), "--validation.enable", "false", "--checkpoint.enable", "false",
           "--metrics.enable_tensorboard", "false", "--job.dump_folder", out]
    if args.auto_split:
        cmd += ["--parallelism.pipeline_parallel_auto_split", "true"]
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)}\n{r.stdout}")
    traces = sorted(glob.glob(os.path.join(out, "profile_traces", f"step-{args.steps}*.trace.json")))
    if len(traces) != P:
        sys.exit(f"expected {P} traces of step {args.steps} in {out}/profile_traces, found {traces}")
    return [json.load(open(t)) for t in traces]


def spans(trace):
    """The pass, the actions and the waits of one rank's trace, in absolute µs."""
    origin = trace["otherData"]["clock_origin_us"]
    rank = trace["otherData"]["rank"]
    out = {"rank": rank, "pass": None, "actions": [], "waits": []}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        begin, end = origin + e["ts"], origin + e["ts"] + e["dur"]
        name = e["name"]
        if name == "pipeline.pass":
            out["pass"] = (begin, end)
        elif ACTION.match(name):
            out["actions"].append((begin, end, name))
        elif name.startswith("pipeline.wait_"):
            out["waits"].append((begin, end))
    if out["pass"] is None:
        sys.exit(f"rank {rank}'s trace has no pipeline.pass span")
    return out


def busy(s):
    return sum(e - b for b, e, _ in s["actions"]) - sum(e - b for b, e in s["waits"])


def bubble(s, ranks):
    """Idle share of the pipeline's pass: from the first rank's start to the
    last rank's end, as the closed forms count it."""
    p0, p1 = min(r["pass"][0] for r in ranks), max(r["pass"][1] for r in ranks)
    return 1 - busy(s) / (p1 - p0)


def simulated(schedule, P, m):
    r = subprocess.run(["build/anvil", "pipeline-schedule", "--schedule", schedule, "--ranks", str(P),
                        "--micro-batches", str(m)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       check=True)
    found = re.search(r"simulated bubble: mean ([0-9.]+)", r.stdout)
    return float(found.group(1)) if found else None


def compute_times(ranks):
    """Each action's compute time: its span minus the receive waits inside it."""
    out = {}
    for s in ranks:
        for b, e, name in s["actions"]:
            waited = sum(min(e, we) - max(b, wb) for wb, we in s["waits"] if wb < e and we > b)
            out[name[len("pipeline."):]] = (e - b) - waited
    return out


def program_of(ranks):
    """What each rank ran, in order, read from its trace."""
    return [[name[len("pipeline."):] for _, _, name in sorted(s["actions"])]
            for s in sorted(ranks, key=lambda s: s["rank"])]


def simulated_with(rows, times):
    """The program run with these action times and instant messages (as the
    unit-cost simulator, with this run's costs): each rank's bubble."""
    stages = 1 + max(int(ACTION.match("pipeline." + c).group(1)) for row in rows for c in row)
    done, free, nxt = {}, [0.0] * len(rows), [0] * len(rows)

    def deps(cell):
        s, op, i = ACTION.match("pipeline." + cell).groups()
        s = int(s)
        if op == "F":
            return [f"{s - 1}F{i}"] if s > 0 else []
        if op == "W":
            return [f"{s}I{i}"]
        nxt_stage = [] if s == stages - 1 else [f"{s + 1}B{i}" if f"{s + 1}B{i}" in times else f"{s + 1}I{i}"]
        return [f"{s}F{i}"] + nxt_stage

    progress = True
    while progress:
        progress = False
        for r, row in enumerate(rows):
            while nxt[r] < len(row) and all(d in done for d in deps(row[nxt[r]])):
                cell = row[nxt[r]]
                start = max([free[r]] + [done[d] for d in deps(cell)])
                free[r] = done[cell] = start + times[cell]
                nxt[r] += 1
                progress = True
    makespan = max(free)
    return [1 - sum(times[c] for c in row) / makespan for row in rows]


def messages(ranks):
    """Every boundary tensor sent between ranks: (sender rank, end of the
    action that made it, receiver rank, start of the action that used it)."""
    where = {}
    for s in ranks:
        for b, e, name in s["actions"]:
            where[name[len("pipeline."):]] = (s["rank"], b, e)
    out = []
    for cell, (rank, b, e) in where.items():
        st, op, i = ACTION.match("pipeline." + cell).groups()
        st = int(st)
        to = [f"{st + 1}F{i}"] if op == "F" else [f"{st - 1}B{i}", f"{st - 1}I{i}"] if op in "BI" else []
        for t in to:
            if t in where and where[t][0] != rank:
                out.append((rank, e, where[t][0], where[t][1]))
    return out


def merged_trace(traces, path):
    """Every rank's Chrome trace on one timeline (rank 0's clock)
    with a flow arrow per message between ranks."""
    origin = min(t["otherData"]["clock_origin_us"] for t in traces)
    events = []
    for t in traces:
        shift = t["otherData"]["clock_origin_us"] - origin
        for e in t["traceEvents"]:
            e = dict(e)
            if "ts" in e:
                e["ts"] += shift
            events.append(e)
    for k, (src, sent, dst, used) in enumerate(messages([spans(t) for t in traces])):
        events.append({"ph": "s", "id": k, "name": "message", "cat": "pipeline", "pid": src, "tid": 0,
                       "ts": sent - origin})
        events.append({"ph": "f", "bp": "e", "id": k, "name": "message", "cat": "pipeline", "pid": dst, "tid": 0,
                       "ts": used - origin})
    with open(path, "w") as f:
        json.dump({"traceEvents": events}, f)


def svg(ranks, path, title):
    t0 = min(s["pass"][0] for s in ranks)
    t1 = max(s["pass"][1] for s in ranks)
    width, row, left = 1000, 28, 60
    scale = (width - left - 10) / (t1 - t0)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{row * len(ranks) + 60}" '
             f'font-family="sans-serif" font-size="11">',
             f'<text x="{left}" y="14">{title}: {(t1 - t0) / 1000:.1f} ms; F blue, B green, I teal, W yellow, '
             f'waiting to receive red, grey lines the messages</text>']
    for k, s in enumerate(sorted(ranks, key=lambda s: s["rank"])):
        y = 24 + k * row
        parts.append(f'<text x="4" y="{y + 16}">rank {s["rank"]}</text>')
        for b, e, name in s["actions"]:
            op = ACTION.match(name).group(2)
            x = left + (b - t0) * scale
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{max((e - b) * scale, 0.5):.1f}" height="{row - 6}" '
                         f'fill="{COLOURS[op]}" stroke="white" stroke-width="0.3"><title>{name[9:]}</title></rect>')
            if (e - b) * scale > 22:
                parts.append(f'<text x="{x + 2:.1f}" y="{y + 15}" fill="white">{name[9:]}</text>')
        for b, e in s["waits"]:
            parts.append(f'<rect x="{left + (b - t0) * scale:.1f}" y="{y + row - 10}" '
                         f'width="{max((e - b) * scale, 0.5):.1f}" height="4" fill="{COLOURS["wait"]}"/>')
    order = {s["rank"]: k for k, s in enumerate(sorted(ranks, key=lambda s: s["rank"]))}
    for src, sent, dst, used in messages(ranks):  # a grey line per message between ranks
        y0, y1 = 24 + order[src] * row + (row - 6) / 2, 24 + order[dst] * row + (row - 6) / 2
        parts.append(f'<line x1="{left + (sent - t0) * scale:.1f}" y1="{y0:.0f}" x2="{left + (used - t0) * scale:.1f}" '
                     f'y2="{y1:.0f}" stroke="#555" stroke-width="0.4" stroke-opacity="0.6"/>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--micro-batches", default="4,8,16")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--svg-dir", default="")
    ap.add_argument("--trace-dir", default="", help="write each run's ranks as one Chrome trace here")
    ap.add_argument("--auto-split", action="store_true", help="cut the stages by estimated cost, not layer counts")
    args = ap.parse_args()
    if not os.access("build/anvil", os.X_OK):
        sys.exit("build first: scripts/test.sh or scripts/train.sh")
    subprocess.run(["scripts/prepare_data.sh"], check=True, stdout=subprocess.DEVNULL)
    split = "automatic split" if args.auto_split else "default split"
    print(f"\n## Bubbles: llama3/25M, {split}, seq {args.seq}, micro-batches of 1, step {args.steps} of each run\n")
    print("| schedule | P | m | closed form | simulated, unit costs | simulated, measured costs "
          "| measured | worst rank, measured | busiest / idlest rank's work |")
    print("|---|---|---|---|---|---|---|---|---|")
    for schedule in args.schedules.split(","):
        for P in map(int, args.ranks.split(",")):
            for m in map(int, args.micro_batches.split(",")):
                out = tempfile.mkdtemp(prefix="anvil_bubbles_")
                try:
                    traces = run(args, schedule, P, m, out)
                    ranks = [spans(t) for t in traces]
                finally:
                    shutil.rmtree(out, ignore_errors=True)
                measured = [bubble(s, ranks) for s in ranks]
                work = [busy(s) for s in ranks]
                cf, sim = closed_form(schedule, P, m), simulated(schedule, P, m)
                sim_measured = simulated_with(program_of(ranks), compute_times(ranks))
                print(f"| {schedule} | {P} | {m} | {'' if cf is None else f'{cf:.3f}'} | "
                      f"{'' if sim is None else f'{sim:.3f}'} | {statistics.mean(sim_measured):.3f} | "
                      f"{statistics.mean(measured):.3f} | {max(measured):.3f} | {max(work) / min(work):.2f} |",
                      flush=True)
                if args.svg_dir and P == 4 and m == 8:
                    os.makedirs(args.svg_dir, exist_ok=True)
                    svg(ranks, os.path.join(args.svg_dir, f"pipeline_{schedule}_P4_m8.svg"),
                        f"{schedule}, P = 4, m = 8")
                if args.trace_dir:
                    os.makedirs(args.trace_dir, exist_ok=True)
                    merged_trace(traces, os.path.join(args.trace_dir, f"pipeline_{schedule}_P{P}_m{m}.trace.json"))


if __name__ == "__main__":
    main()
