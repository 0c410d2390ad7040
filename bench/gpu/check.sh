#!/usr/bin/env bash
# The one-call GPU check. The GPU machine is lent rarely, for 15 minutes of
# device time in all, through a tool that runs one command and may show only
# the last lines of its output; so everything the GPU is needed for runs here
# in one command of at most 6 minutes, each step under its own timeout and
# leaving JSON, with the summary table printed last. --rehearse runs the same
# script end to end on a machine without a GPU (CI: ctest CudaGpuCheck.Rehearsal),
# so that unpacking, libraries, timeouts and the JSON are known to work before
# GPU time is spent.
#
#   bench/gpu/check.sh [--rehearse] [--out DIR] [--only NN,...] [PACK]
#
# PACK: bench/gpu/pack.sh's archive (default .gpu/anvil-gpu.tar.xz).
# DIR:  $OUT when set (the device tool's output folder), else /tmp/anvil-gpu-check.
# --only 03,05: those steps alone (and 00, the unpacking); the others record skipped.
# On the GPU machine, with the device tool (docs/gpu.md, "The one-call check"):
#   run  command: bash bench/gpu/check.sh --out $OUT .gpu/anvil-gpu.tar.xz
#        carry: [".gpu"]   timeout_s: 420
#
# Steps, in order; limits in seconds, each also cut to what is left of the
# 360 s budget (counted by $SECONDS from the start, unpacking included):
#   00 unpack         the pack into a temporary folder
#   01 machine    15  nvidia-smi; the cuBLAS, cuBLASLt and cuDNN bin/anvil loads
#                     (ldd); every packed binary finds its libraries; anvil info
#   02 op-tests   45  every packed cuda_*_test, gtest JSON per binary
#   03 parity     90  anvil train --job.device cuda against --job.device cpu: the
#                     debug model and llama3_25m, 10 steps, fp32 within 1e-5 (losses,
#                     gradient norms, final weights), bf16's loss gap at most twice the
#                     CPU's; every AC mode and accumulation 2 against the GPU's fp32 run;
#                     block-causal attention (bf16: cuDNN's ragged SDPA) fp32 and bf16
#   04 memory     30  Llama 3 1B's device peaks, each category equal to anvil estimate
#                     --job.device cuda's to the byte, reserved within 2%
#   05 speed     150  Anvil's rows (tokens/s, reserved, op table) beside PyTorch's
#                     (bench/gpu/torch_reference.py), with the ratios
#   06 sanitizer  30  compute-sanitizer memcheck on a few op tests
#   07 calibration    the time left: anvil calibrate, bench/gpu/calibrate.py, anvil estimate
#
# Steps 03-05 compare with bench/gpu/parity.py, whose verdicts (every figure) their JSON holds as
# "comparisons", beside "runs" (each Anvil command, its status and time) and "self_test": the
# comparator fed copies of real runs with one figure moved past a bound, which must fail on it.
# Each step writes DIR/<nn>-<step>.log (its whole output) and DIR/<nn>-<step>.json:
#   {"step", "status": passed|failed|skipped|timed_out, "exit_code",
#    "seconds", "limit_seconds", "why" (one line; "" when passed), "result"
#    (one line), step-specific fields}
# and DIR/<nn>-<step>/ for its other files. At the end DIR holds summary.json
# (every step's JSON in full), summary.md (the table printed last), check.log
# (this script's own output), calibration.json when one was made, and
# steps.tar.gz with the <nn>-<step> files: the device tool returns at most 8
# files from $OUT, so the step files travel in one archive.
#
# --rehearse (no GPU): the GPU-only commands record "skipped" (no GPU) instead of
# failing, PyTorch's rows and calibrate.py run small on the CPU (where a python3
# has torch), and everything else runs as on the GPU machine: the pack is
# unpacked and its binaries are loaded, run and their output parsed. Steps 03-05
# then run their CPU parts small (the CPU halves of the debug model's parity runs,
# the dry runs, a CPU stand-in of a speed row, every self-test) and end "skipped"
# when those passed, "failed" when one did not.
# Exit status: 1 if a step failed or timed out, or a step's JSON is missing or
# malformed (skipped steps do not fail the check); else 0.
set -uo pipefail

usage() { sed -n '11,19p' "$0" | sed 's/^# \{0,1\}//'; }
rehearse=0
only=
out=
pack=
while (($#)); do
  case $1 in
    --rehearse) rehearse=1 ;;
    --out) out=${2:?--out needs a folder}; shift ;;
    --out=*) out=${1#--out=} ;;
    --only) only=${2:?--only needs step numbers}; shift ;;
    --only=*) only=${1#--only=} ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "check.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) pack=$1 ;;
  esac
  shift
done
out=$(realpath -m "${out:-${OUT:-/tmp/anvil-gpu-check}}")
[ -n "$pack" ] && pack=$(realpath -m "$pack")
cd "$(dirname "$0")/../.." || exit 1
pack=${pack:-$PWD/.gpu/anvil-gpu.tar.xz}

budget=360
reserve=15  # for a step's kill grace (timeout -k 5), the summary and the archive
mkdir -p "$out" || exit 1
# Only this script's own files are cleared, so --out may name any folder.
rm -rf "$out"/[0-9][0-9]-* "$out"/summary.json "$out"/summary.md "$out"/check.log \
  "$out"/calibration.json "$out"/steps.tar.gz
exec 3>&1 4>&2 > >(tee "$out/check.log") 2>&1
tee_pid=$!

root=$(mktemp -d /tmp/anvil-gpu.XXXXXX)
trap 'rm -rf "$root"' EXIT
anvil=$root/bin/anvil
# The packed Debian libraries are for the packed binaries alone (packed_within,
# ldd): PyTorch keeps the environment it was installed for.
pack_ld="$root/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export rehearse out root anvil pack pack_ld PYTHONUNBUFFERED=1
# A command that cannot run without a GPU: skipped in a rehearsal, a failure on the GPU machine.
nogpu_status=failed
((rehearse)) && nogpu_status=skipped
export nogpu_status
gpu=$(timeout -k 2 10 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
export gpu
# The python3 for bench/gpu/parity.py: one with numpy where there is one (the GPU machine's python3;
# here perhaps Debian's behind another), else the first, on which parity.py's slower path runs.
pynp=python3
for c in python3 /usr/bin/python3; do
  if timeout 30 "$c" -c 'import numpy' 2>/dev/null; then pynp=$c; break; fi
done
export pynp
# The python3 with PyTorch: the GPU machine's python3; in a rehearsal perhaps
# Debian's (/usr/bin/python3 with python3-torch) behind another python3.
py=
for c in python3 /usr/bin/python3; do
  if timeout 60 "$c" -c 'import torch' 2>/dev/null; then py=$c; break; fi
done
export py

echo "check.sh: $( ((rehearse)) && echo rehearsal || echo GPU check) of $pack, $(date -u '+%F %T UTC')," \
  "GPU: ${gpu:-none}, python3 with torch: ${py:-none}; files in $out"

# ---- helpers for the steps (each step runs in its own bash under timeout) ----

one_line() { printf %s "$1" | tr '\t\n' '  '; }
fact() { printf 's\t%s\t%s\n' "$1" "$(one_line "$2")" >>"$STEP_FACTS"; }   # a string
factj() { printf 'j\t%s\t%s\n' "$1" "$(one_line "$2")" >>"$STEP_FACTS"; }  # JSON; the last of a key wins
verdict() { printf '%s\t%s\n' "$1" "$(one_line "$2")" >"$STEP_VERDICT"; }   # a status other than passed
left() { echo $((STEP_DEADLINE - $(date +%s))); }
# within CMD...: CMD under what is left of the step's time, or WITHIN_CAP seconds
# when that is less (exit 124 when it runs out).
within() {
  local l
  l=$(left)
  ((${WITHIN_CAP:-0} > 0 && WITHIN_CAP < l)) && l=$WITHIN_CAP
  ((l > 0)) || { echo "(no time left for: $*)"; return 124; }
  timeout -k 5 "$l" "$@"
}
packed_within() { within env LD_LIBRARY_PATH="$pack_ld" "$@"; }
# ---- helpers of the Anvil runs (steps 03-05); each writes under its caller's $dir ----

# anvil_flags: sets RUN_FLAGS, what every anvil train and estimate of the check adds to its config.
# The data: the repository's own docs/*.md (about 450 KB of text) read as bytes, since the configs'
# Shakespeare corpus and BPE tokenizer (data/, which git ignores) are not on the GPU machine: the
# device tool carries only .gpu and the pack holds binaries alone; the docs travel as tracked files.
# Causal attention, as PyTorch's rows are (step 03 also runs block-causal attention over
# documents of its own). Metrics every step; no validation, traces, memory snapshots or
# TensorBoard: the comparisons read none of them, and they cost time.
anvil_flags() {
  RUN_FLAGS=(--model.tokenizer_path= --training.dataset text --training.dataset_path 'docs/*.md'
    --model.attn_mask_type causal --metrics.log_freq 1 --validation.enable false
    --profiling.enable_profiling false --profiling.enable_memory_snapshot false --metrics.enable_tensorboard false)
}
# train_run NAME DEVICE FLAGS...: anvil train FLAGS --job.device DEVICE --job.dump_folder $dir/NAME,
# its output in $dir/NAME.log and a row in $dir/runs.tsv. Without a GPU a cuda run is not started:
# skipped in a rehearsal, failed on the GPU machine; with SKIP_WHY set, no run is started and
# that is the reason recorded. Returns 0 when the run passed.
train_run() { anvil_run train "$@"; }
# estimate_run NAME DEVICE FLAGS...: anvil estimate FLAGS --job.device DEVICE --json, its JSON in
# $dir/NAME.json and the rest of its output in $dir/NAME.log; the dry run needs no GPU, for cuda too.
estimate_run() { anvil_run estimate "$@"; }
anvil_run() {
  local what=$1 name=$2 device=$3 rc=0 status=passed why="" t0 secs=0
  shift 3
  local cmd=("$anvil" "$what" "$@" --job.device "$device") args
  args=$(printf '%q ' "$@" --job.device "$device")  # as a shell takes it back (docs/\*.md)
  args=${args% }
  if [ "$what" = train ]; then
    rm -rf "${dir:?}/$name"
    cmd+=(--job.dump_folder "$dir/$name")
  else
    cmd+=(--json)
  fi
  if [ -n "${SKIP_WHY:-}" ]; then
    status=skipped why=$SKIP_WHY
    echo "== $name: skipped ($why): anvil $what $args"
  elif [ "$what" = train ] && [ "$device" = cuda ] && [ -z "$gpu" ]; then
    status=$nogpu_status why="no GPU"
    echo "== $name: $status (no GPU): anvil $what $args"
  elif (($(left) < 2)); then
    status=timed_out why="not started: the step's time was spent"
    echo "== $name: $why: anvil $what $args"
  else
    echo "== $name: anvil $what $args"
    t0=$(date +%s.%N)
    if [ "$what" = train ]; then
      packed_within "${cmd[@]}" >"$dir/$name.log" 2>&1
    else
      packed_within "${cmd[@]}" >"$dir/$name.json" 2>"$dir/$name.log"
    fi
    rc=$?
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    if ((rc == 124 || rc == 137)); then
      status=timed_out why="stopped at its time limit after $secs s"
    elif ((rc)); then
      # Its last line says why (an estimate's error goes to stderr, its .log).
      why=$(grep . "$dir/$name.log" | tail -1)
      [ -n "$why" ] || why=$(grep . "$dir/$name.json" 2>/dev/null | tail -1)
      status=failed why="exit $rc: $(cut -c1-300 <<<"${why:-no output}")"
    fi
    grep . "$dir/$name.log" | tail -2 | sed 's/^/   | /'
    echo "   $name: $status in $secs s${why:+: $why}"
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$what" "$device" "$status" "$rc" "$secs" "$(one_line "$why")" \
    "anvil $what $args" >>"$dir/runs.tsv"
  [ "$status" = passed ]
}
# compare NAME "RUNS" KIND ARGS...: bench/gpu/parity.py KIND ARGS, its verdict with every figure in
# $dir/verdicts/. Made only when each run RUNS names (runs.tsv's NAME) passed; else recorded as not
# made, its reason being that run's own row. Returns parity.py's exit status.
compare() { parity_call verdicts "" "$@"; }
# self_test EXPECT NAME "RUNS" KIND ARGS...: the same, into $dir/self_test/, held to EXPECT: pass, or
# the bound it must fail on (parity.py --expect). A comparator that cannot fail proves nothing, so
# each step also feeds its comparator copies of real runs with one figure moved just past a bound.
self_test() { parity_call self_test "$@"; }
parity_call() {
  local folder=$dir/$1 expect=$2 name=$3 runs=$4 kind=$5 r st file rc
  shift 5
  mkdir -p "$folder"
  local earlier=("$folder"/*.json)
  [ -e "${earlier[0]}" ] || earlier=()
  file=$folder/$(printf %02d $((${#earlier[@]} + 1)))-$(tr -cs 'A-Za-z0-9' '-' <<<"$name" | sed 's/-*$//').json
  # What stays when parity.py is stopped before it writes its own (the names are the check's own
  # words: no quotes or backslashes to escape).
  printf '{"check": "%s", "name": "%s", "expect": "%s", "passed": false, "as_expected": false, "why": "%s", "line": "%s"}\n' \
    "$kind" "$name" "$expect" "parity.py did not write its verdict" "$kind $name: parity.py did not finish" >"$file"
  for r in $runs; do
    st=$(awk -F'\t' -v n="$r" '$1 == n { s = $4 } END { print s }' "$dir/runs.tsv" 2>/dev/null)
    if [ "$st" != passed ]; then
      echo "   $kind $name: not made: run $r ${st:-did not start}"
      printf '{"check": "%s", "name": "%s", "expect": "%s", "made": false, "why": "%s", "line": "%s"}\n' \
        "$kind" "$name" "$expect" "not made: run $r ${st:-did not start}" "$kind $name: not made: run $r ${st:-did not start}" >"$file"
      return 0
    fi
  done
  local with=()
  [ -n "$expect" ] && with=(--expect "$expect")
  within "$pynp" bench/gpu/parity.py "$kind" --name "$name" --json "$file" "${with[@]}" "$@" 2>&1 | sed 's/^/   /'
  rc=${PIPESTATUS[0]}
  return "$rc"
}
# perturb SRC COPY HOW...: $dir/copies/COPY, a copy of the run $dir/SRC with one figure moved
# (parity.py perturb), recorded as the run copies/COPY (a self-test over it is made only when the
# copy is). The copies are deleted with the checkpoints when the step ends.
perturb() {
  local src=$1 dst=copies/$2 status=passed why=""
  shift 2
  mkdir -p "$dir/copies"
  if [ "$(awk -F'\t' -v n="$src" '$1 == n { s = $4 } END { print s }' "$dir/runs.tsv")" != passed ]; then
    status=skipped why="no $src to copy"
  elif ! within "$pynp" bench/gpu/parity.py perturb "$dir/$src" "$dir/$dst" "$@" 2>&1 | sed 's/^/   /'; then
    status=failed why="parity.py perturb $* failed"
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$dst" perturb host "$status" 0 0 "$why" "parity.py perturb $src $dst $*" >>"$dir/runs.tsv"
}
# finish_step KIND: the step's JSON facts from what it left in $dir (runs, comparisons, self-tests,
# PyTorch's rows), its result line and its status: failed when a run failed or ran out of time, a
# comparison failed, or a self-test was not as expected; else skipped when a cuda run was skipped
# (a rehearsal: what a CPU can run ran and passed); else passed. The checkpoints and the perturbed
# copies are deleted first: steps.tar.gz must stay under the device tool's 16 MiB a file.
finish_step() {
  rm -rf "${dir:?}"/*/checkpoint "$dir/copies"
  "$pynp" - "$1" "$dir" <<'PY'
import glob, json, os, sys
kind, d = sys.argv[1], sys.argv[2]
fields = ("name", "what", "device", "status", "exit_code", "seconds", "why", "command")
runs = []
if os.path.exists(os.path.join(d, "runs.tsv")):
    for line in open(os.path.join(d, "runs.tsv")):
        r = dict(zip(fields, line.rstrip("\n").split("\t")))
        r.update(exit_code=int(r["exit_code"]), seconds=float(r["seconds"]))
        runs.append(r)
load = lambda sub: [json.load(open(f)) for f in sorted(glob.glob(os.path.join(d, sub, "*.json")))]
comparisons, tests = load("verdicts"), load("self_test")
torch_rows = [json.loads(l) for l in open(os.path.join(d, "pytorch_rows.jsonl"))] \
    if os.path.exists(os.path.join(d, "pytorch_rows.jsonl")) else []
made = [c for c in comparisons if c.get("made", True)]
failures = [f"{r['name']}: {r['status']}: {r['why']}" for r in runs if r["status"] in ("failed", "timed_out")]
failures += [c["line"] for c in made if not c.get("passed")]
failures += [t["line"] for t in tests if not t.get("as_expected")]
failures += [f"PyTorch {t['label']}: {t['status']}: {t.get('why', '')}" for t in torch_rows if t["status"] != "passed"]
skipped = [r for r in runs if r["status"] == "skipped" and r["device"] == "cuda"]
fmt = lambda x: f"{x:.2g}" if isinstance(x, float) else "n/a"

parts = []
if kind == "parity":
    m = [c for c in made if c["check"] == "match" and c.get("passed")]
    gaps = [c for c in made if c["check"] == "gap" and c.get("passed")]
    if m:
        worst = lambda k: max((c.get(k) for c in m if c.get(k) is not None), default=None)
        w = max((c["weights"]["ratio"] for c in m if c.get("weights", {}).get("ratio") is not None), default=None)
        parts.append(f"{len(m)} matched: worst loss {fmt(worst('max_loss_rel_diff'))}, grad_norm "
                     f"{fmt(worst('max_grad_norm_rel_diff'))}, weights {fmt(w)} (bounds 1e-05)")
    if gaps:
        parts.append(f"bf16 gap ratio up to {fmt(max(c['ratio'] for c in gaps))} (bound 2)")
elif kind == "memory":  # the measured against the dry run first, then the dry run's own figures
    for c in sorted(made, key=lambda c: c["check"] != "memory"):
        if c.get("passed") and c["check"] in ("memory", "estimate"):
            parts.append(f"{c['name']}: {c['summary']}")
elif kind == "speed":  # each row: Anvil's figures and their ratios to PyTorch's
    beside = set()
    for c in made:
        if c.get("passed"):
            t = c.get("torch") or {}
            ratio = lambda k: f" (x{c[k]:.2f} PyTorch's)" if k in c else ""
            parts.append(f"{c['name']}: Anvil {c['tokens_per_s']:,.0f} tok/s{ratio('tokens_per_s_ratio')}, "
                         f"{c['max_reserved_bytes'] / 2**30:.1f} GiB{ratio('reserved_ratio')}")
            beside.add(t.get("args"))
    for t in torch_rows:
        base = {True: " (baseline)", False: " (not a baseline: >5% off DEVICE.md)"}.get(t.get("baseline"), "")
        if t["status"] == "passed" and (t["args"] not in beside or base):
            mem = f", {t['max_reserved_gib']:.1f} GiB" if "max_reserved_gib" in t else ""
            parts.append(f"PyTorch {t['label']} {t['tokens_per_s']:,.0f} tok/s{mem}{base}")
cpu = [r for r in runs if r["device"] != "cuda" or r["what"] == "estimate"]
cpu_passed = sum(r["status"] == "passed" for r in cpu)
if skipped:  # a rehearsal: say what ran in their stead
    n = sum(r["status"] == "passed" for r in cpu if r["what"] != "perturb")
    parts.append(f"{n} run{'s' if n != 1 else ''} without a GPU passed")
if tests:
    parts.append(f"self-test {sum(bool(t.get('as_expected')) for t in tests)} of {len(tests)} as expected")
facts = {
    "runs": runs, "comparisons": comparisons, "self_test": tests,
    "counts": {"runs": {s: sum(r["status"] == s for r in runs) for s in ("passed", "failed", "timed_out", "skipped")},
               "cpu_parts_passed": cpu_passed, "cpu_parts": len(cpu),
               "comparisons_made": len(made), "comparisons_passed": sum(bool(c.get("passed")) for c in made),
               "self_tests": len(tests), "self_tests_as_expected": sum(bool(t.get("as_expected")) for t in tests)},
    "result": "; ".join(parts) or "nothing ran",
}
with open(os.environ["STEP_FACTS"], "a") as f:
    for k, v in facts.items():
        f.write(("s" if k == "result" else "j") + f"\t{k}\t" + (v if k == "result" else json.dumps(v)).replace("\t", " ").replace("\n", " ") + "\n")
status = why = None
if failures:
    status, why = "failed", failures[0] + (f" (and {len(failures) - 1} more)" if len(failures) > 1 else "")
elif skipped:
    status = "skipped"
    why = f"no GPU: {len(skipped)} --job.device cuda runs skipped, all else passed"
if status:
    open(os.environ["STEP_VERDICT"], "w").write(f"{status}\t{why}\n")
sys.exit(status == "failed")
PY
}

# ---- the steps ----

step_unpack() {
  tar -C "$root" -xf "$pack" || { verdict failed "cannot unpack $pack (bench/gpu/pack.sh makes it)"; return 1; }
  [ -x "$anvil" ] || { verdict failed "$pack has no bin/anvil"; return 1; }
  local tests=("$root"/bin/cuda_*_test)
  [ -x "${tests[0]}" ] || { verdict failed "$pack has no cuda_*_test"; return 1; }
  fact result "$(ls "$root/bin" | wc -l) binaries, $(ls "$root/lib" | wc -l) libraries, $(du -sm "$root" | cut -f1) MB unpacked"
}

step_machine() {
  local smi="" ok=1
  if [ -n "$gpu" ]; then
    within nvidia-smi
    smi=$(within nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)
    fact gpu "$smi"
  else
    echo "nvidia-smi: $(command -v nvidia-smi >/dev/null && echo 'lists no GPU' || echo 'not on this machine')"
  fi
  # Every packed binary must find every library it loads, each from the pack's
  # lib/ or among those the GPU machine has (pack.sh's system-libs.regex): a
  # library found only because this machine happens to have it fails here too.
  local skip b name path
  local -A missing=()  # library -> where it was found instead, and by how many binaries
  skip=$(cat "$root/system-libs.regex") || { verdict failed "the pack has no system-libs.regex (pack it again)"; return 1; }
  for b in "$root"/bin/*; do
    while read -r name path; do
      if [ "$path" = not ] || [[ $path != "$root"/lib/* && ! $name =~ $skip ]]; then
        echo "$(basename "$b"): $name => $path"
        [ "$path" = not ] && path="not found"
        missing[$name]="$path, $((${missing[$name]##*, } + 1))"
      fi
    done < <(LD_LIBRARY_PATH=$pack_ld ldd "$b" | awk '$2 == "=>" {print $1, $3}')
  done
  echo "== ldd $anvil (LD_LIBRARY_PATH=$pack_ld)"
  LD_LIBRARY_PATH=$pack_ld ldd "$anvil" | tee "$STEP_FACTS.ldd"
  factj libraries "$(python3 -c '
import json, os, re, sys
libs = []
for line in open(sys.argv[1]):
    m = re.match(r"\s*(libcublas\.so|libcublasLt\.so|libcudnn\.so)\S*\s+=>\s+(\S+)", line)
    if m and os.path.exists(m.group(2)):
        real = os.path.realpath(m.group(2))
        libs.append({"name": m.group(1), "path": m.group(2), "file": real,
                     "version": re.sub(r"^.*\.so\.", "", os.path.basename(real))})
print(json.dumps(libs))' "$STEP_FACTS.ldd")"
  rm -f "$STEP_FACTS.ldd"
  local version info
  version=$(packed_within "$anvil" --version 2>&1) || ok=0
  info=$(packed_within "$anvil" info 2>&1) || ok=0
  printf '== anvil --version\n%s\n== anvil info\n%s\n' "$version" "$info"
  fact anvil_version "$version"
  fact cuda_runtime "$(grep '^CUDA runtime' <<<"$info")"
  fact cuda_devices "$(grep '^CUDA devices' <<<"$info")"
  fact date "$(date -u '+%F %T UTC')"
  fact git_commit "$(git rev-parse HEAD 2>/dev/null || echo 'none (no .git here)')"
  local nbins
  nbins=$(ls "$root/bin" | wc -l)
  fact result "${smi:+$smi; }loaded: $(grep -o 'cuBLAS.*' <<<"$info" | head -1); $( ((${#missing[@]})) && echo "libraries not loadable from the pack: ${#missing[@]}" || echo "all $nbins binaries load their libraries from the pack or the system's CUDA/C runtime")"
  if ((${#missing[@]})); then
    local why=""
    for name in "${!missing[@]}"; do
      why+="${why:+; }$name (${missing[$name]##*, } binaries; ${missing[$name]%, *})"
    done
    verdict failed "not loadable from the pack: $why"
    return 1
  fi
  ((ok)) || { verdict failed "bin/anvil does not run: $(tail -1 <<<"$info")"; return 1; }
  [ -n "$gpu" ] || { verdict "$nogpu_status" "no GPU (nvidia-smi lists none)"; return 0; }
  grep -q '^CUDA devices: none' <<<"$info" && { verdict failed "nvidia-smi lists $gpu but bin/anvil sees no CUDA device"; return 1; }
  return 0
}

step_op_tests() {
  local dir=$out/02-op-tests t rc
  mkdir -p "$dir"
  for t in "$root"/bin/cuda_*_test; do
    echo "== $(basename "$t")"
    packed_within "$t" --gtest_brief=1 --gtest_output="json:$dir/$(basename "$t").json"
    rc=$?
    printf '%s\t%s\n' "$(basename "$t")" "$rc" >>"$dir/exit_codes.tsv"
  done
  # Per binary: its counts from its gtest JSON, and its exit status.
  python3 - "$dir" <<'PY'
import json, os, sys
d = sys.argv[1]
binaries, failed_names, problems = [], [], []
gpu = bool(os.environ.get("gpu"))
for line in open(os.path.join(d, "exit_codes.tsv")):
    name, rc = line.rstrip("\n").split("\t")
    row = {"binary": name, "exit_code": int(rc), "tests": 0, "passed": 0, "failed": 0, "skipped": 0, "failed_tests": []}
    try:
        g = json.load(open(os.path.join(d, name + ".json")))
    except (OSError, ValueError) as e:
        problems.append(f"{name} exit {rc}, no gtest JSON" if int(rc) else f"{name}: gtest JSON unreadable ({e})")
        binaries.append(row)
        continue
    skipped_tests = []
    for suite in g.get("testsuites", []):
        for case in suite.get("testsuite", []):
            full = f"{suite['name']}.{case['name']}"
            row["tests"] += 1
            if case.get("failures"):
                row["failed"] += 1
                row["failed_tests"].append(full)
            elif case.get("result") == "SKIPPED":
                row["skipped"] += 1
                skipped_tests.append(full)
            else:
                row["passed"] += 1
    if gpu:  # on a GPU a skip is news: name them
        row["skipped_tests"] = skipped_tests
    if int(rc) and not row["failed"]:
        problems.append(f"{name} exit {rc}")
    failed_names += row["failed_tests"]
    binaries.append(row)
tot = {k: sum(b[k] for b in binaries) for k in ("tests", "passed", "failed", "skipped")}
result = f"{len(binaries)} binaries: {tot['passed']} passed, {tot['failed']} failed, {tot['skipped']} skipped"
facts = {"binaries": binaries, "totals": tot, "failed_tests": failed_names, "result": result}
with open(os.environ["STEP_FACTS"], "a") as f:
    for k, v in facts.items():
        f.write(f"j\t{k}\t{json.dumps(v)}\n")
if failed_names or problems:
    why = "; ".join(problems + ([f"failed: {', '.join(failed_names[:5])}" + (" ..." if len(failed_names) > 5 else "")] if failed_names else []))
    open(os.environ["STEP_VERDICT"], "w").write(f"failed\t{why}\n")
    sys.exit(1)
PY
}

step_parity() {
  local dir=$out/03-parity m WITHIN_CAP=20
  mkdir -p "$dir"
  anvil_flags
  # The same steps on the GPU and on the CPU from the same seed, fp32 with TF32 off (cuBLASLt's
  # CUBLAS_COMPUTE_32F). Without a GPU (a rehearsal) the CPU halves are all that run, so they run
  # small (3 steps of the debug model at batch 2, seq 128): they prove the runs, the comparator and
  # the JSON, not parity. llama3_25m (GQA) at seq 256, not its config's 512: the CPU halves are
  # most of this step's time.
  local steps=10 small=() cpu_why=""
  if [ -z "$gpu" ]; then
    steps=3 small=(--training.local_batch_size 2 --training.seq_len 128) cpu_why="rehearsal: the debug model's CPU halves only"
  fi
  local fp32=(--training.mixed_precision_param float32) bf16=(--training.mixed_precision_param bfloat16)
  # The final weights: fp32 master weights, saved at the last step, synchronously.
  local ckpt=(--checkpoint.enable --checkpoint.interval "$steps" --checkpoint.async_mode disabled
    --checkpoint.last_save_model_only --checkpoint.export_dtype float32)
  for m in debugmodel llama3_25m; do
    local run=("configs/$m.toml" "${RUN_FLAGS[@]}" --training.steps "$steps" --training.seed 0 --training.deterministic
      --activation_checkpoint.mode none)
    local skip_cpu=""
    if [ "$m" = llama3_25m ]; then
      run+=(--training.seq_len 256)
      skip_cpu=$cpu_why
    else
      run+=("${small[@]}")
    fi
    train_run "$m-fp32-cuda" cuda "${run[@]}" "${fp32[@]}" "${ckpt[@]}"
    SKIP_WHY=$skip_cpu train_run "$m-fp32-cpu" cpu "${run[@]}" "${fp32[@]}" "${ckpt[@]}"
    compare "fp32 $m" "$m-fp32-cpu $m-fp32-cuda" match "$dir/$m-fp32-cpu" "$dir/$m-fp32-cuda" --steps "$steps"
    train_run "$m-bf16-cuda" cuda "${run[@]}" "${bf16[@]}"
    SKIP_WHY=$skip_cpu train_run "$m-bf16-cpu" cpu "${run[@]}" "${bf16[@]}"
    compare "bf16 $m" "$m-fp32-cpu $m-bf16-cpu $m-fp32-cuda $m-bf16-cuda" gap \
      "$dir/$m-fp32-cpu" "$dir/$m-bf16-cpu" "$dir/$m-fp32-cuda" "$dir/$m-bf16-cuda"
    [ "$m" = debugmodel ] || continue
    # The comparator's self-test over the debug model's CPU runs: each figure it holds moved 3 times
    # its bound must fail on that bound (a bf16 gap: every bf16 loss 1% off, tens of times the gap).
    # Its passing case is the GPU run; in a rehearsal a second CPU run stands in.
    local ref=$dir/debugmodel-fp32-cpu
    if [ -z "$gpu" ]; then
      train_run debugmodel-fp32-cpu-again cpu "${run[@]}" "${fp32[@]}" "${ckpt[@]}"
      self_test pass "CPU fp32 against a second CPU run" "debugmodel-fp32-cpu debugmodel-fp32-cpu-again" match \
        "$ref" "$dir/debugmodel-fp32-cpu-again" --steps "$steps"
      self_test pass "CPU bf16 gap against itself" "debugmodel-fp32-cpu debugmodel-bf16-cpu debugmodel-fp32-cpu-again" gap \
        "$ref" "$dir/debugmodel-bf16-cpu" "$dir/debugmodel-fp32-cpu-again" "$dir/debugmodel-bf16-cpu"
    fi
    perturb debugmodel-fp32-cpu loss --loss-rel 3e-5 --step 2
    self_test loss "step 2's loss 3e-5 off" "debugmodel-fp32-cpu copies/loss" match "$ref" "$dir/copies/loss" --steps "$steps"
    perturb debugmodel-fp32-cpu grad-norm --grad-norm-rel 3e-5 --step 2
    self_test grad_norm "step 2's grad_norm 3e-5 off" "debugmodel-fp32-cpu copies/grad-norm" match "$ref" "$dir/copies/grad-norm" --steps "$steps"
    perturb debugmodel-fp32-cpu weight --weight-rel 3e-5
    self_test weights "one weight 3e-5 of the largest off" "debugmodel-fp32-cpu copies/weight" match "$ref" "$dir/copies/weight" --steps "$steps"
    perturb debugmodel-bf16-cpu bf16 --loss-rel 1e-2
    self_test gap "bf16 losses 1% off" "debugmodel-fp32-cpu debugmodel-bf16-cpu copies/bf16" gap \
      "$ref" "$dir/debugmodel-bf16-cpu" "$ref" "$dir/copies/bf16"
  done
  # Activation checkpointing and gradient accumulation on the GPU, fp32: each as the GPU's fp32 run
  # without AC at batch 8 (above), within the same bounds.
  local gpu_run=(configs/llama3_25m.toml "${RUN_FLAGS[@]}" --training.steps "$steps" --training.seed 0
    --training.deterministic --training.seq_len 256 "${fp32[@]}" "${ckpt[@]}")
  local ac name
  for ac in "selective op" "selective 2" full; do
    set -- $ac
    name=llama3_25m-ac-$1${2:+-$2}
    train_run "$name" cuda "${gpu_run[@]}" --activation_checkpoint.mode "$1" ${2:+--activation_checkpoint.selective_ac_option "$2"}
    compare "AC $ac" "llama3_25m-fp32-cuda $name" match "$dir/llama3_25m-fp32-cuda" "$dir/$name" --steps "$steps"
  done
  train_run llama3_25m-accum2 cuda "${gpu_run[@]}" --activation_checkpoint.mode none \
    --training.local_batch_size 4 --training.global_batch_size 8
  compare "accumulation 2" "llama3_25m-fp32-cuda llama3_25m-accum2" match \
    "$dir/llama3_25m-fp32-cuda" "$dir/llama3_25m-accum2" --steps "$steps"
  # Block-causal attention: bf16 through cuDNN's ragged SDPA, fp32 through the plain attention's
  # row softmax from each row's document start. The documents are the docs' paragraphs, one JSON
  # Lines document each (a few hundred bytes), so every sequence holds several. The debug model,
  # fp32 GPU against CPU and the bf16 gap, as above.
  "$pynp" -c '
import json, re, sys
with open(sys.argv[1], "w") as out:
    for path in sorted(sys.argv[2:]):
        for para in re.split(r"\n\s*\n", open(path, encoding="utf-8").read()):
            if para.strip():
                out.write(json.dumps({"text": para.strip()}) + "\n")
' "$dir/paragraphs.jsonl" docs/*.md
  local block=(configs/debugmodel.toml "${RUN_FLAGS[@]}" --training.steps "$steps" --training.seed 0
    --training.deterministic --activation_checkpoint.mode none "${small[@]}" --model.attn_mask_type block_causal
    --training.dataset_path "$dir/paragraphs.jsonl")
  train_run block-fp32-cuda cuda "${block[@]}" "${fp32[@]}" "${ckpt[@]}"
  train_run block-fp32-cpu cpu "${block[@]}" "${fp32[@]}" "${ckpt[@]}"
  compare "fp32 block-causal" "block-fp32-cpu block-fp32-cuda" match "$dir/block-fp32-cpu" "$dir/block-fp32-cuda" \
    --steps "$steps"
  train_run block-bf16-cuda cuda "${block[@]}" "${bf16[@]}"
  train_run block-bf16-cpu cpu "${block[@]}" "${bf16[@]}"
  compare "bf16 block-causal" "block-fp32-cpu block-bf16-cpu block-fp32-cuda block-bf16-cuda" gap \
    "$dir/block-fp32-cpu" "$dir/block-bf16-cpu" "$dir/block-fp32-cuda" "$dir/block-bf16-cuda"
  finish_step parity
}

step_memory() {
  local dir=$out/04-memory
  mkdir -p "$dir"
  anvil_flags
  # Llama 3 1B, seq 8192, batch 1, no AC, 3 steps from random initialisation (no weights needed).
  # No checkpoint: with one the dry run also plans the save, which no metrics line measures.
  local run=(configs/llama3_1b.toml "${RUN_FLAGS[@]}" --training.seq_len 8192 --training.local_batch_size 1
    --activation_checkpoint.mode none --training.steps 3 --checkpoint.enable false)
  estimate_run 1b-estimate cuda "${run[@]}"
  compare "1B dry run" 1b-estimate estimate "$dir/1b-estimate.json"
  train_run 1b cuda "${run[@]}"
  compare "1B" "1b-estimate 1b" memory "$dir/1b-estimate.json" "$dir/1b" --source device
  # The comparator's self-test, on the CPU, whose run equals its dry run to the byte: it must pass
  # there, and fail with one byte more in one category, or 5% more reserved (5%: past the 2% bound
  # from anywhere within it). On a GPU also one byte more in the 1B run's device figures.
  local tiny=(configs/debugmodel.toml "${RUN_FLAGS[@]}" --training.local_batch_size 2 --training.seq_len 128
    --training.steps 3 --checkpoint.enable false)
  estimate_run debugmodel-cpu-estimate cpu "${tiny[@]}"
  train_run debugmodel-cpu cpu "${tiny[@]}"
  local est=$dir/debugmodel-cpu-estimate.json
  self_test pass "CPU run against its dry run" "debugmodel-cpu-estimate debugmodel-cpu" memory "$est" "$dir/debugmodel-cpu" --source host
  perturb debugmodel-cpu byte --add-bytes 1 --category activations --source host
  self_test category "one byte more activations" "debugmodel-cpu-estimate copies/byte" memory "$est" "$dir/copies/byte" --source host
  perturb debugmodel-cpu reserved --reserved-rel 0.05 --source host
  self_test reserved "5% more reserved" "debugmodel-cpu-estimate copies/reserved" memory "$est" "$dir/copies/reserved" --source host
  if [ -n "$gpu" ]; then
    perturb 1b device-byte --add-bytes 1 --category activations --source device
    self_test category "1B: one byte more device activations" "1b-estimate copies/device-byte" memory \
      "$dir/1b-estimate.json" "$dir/copies/device-byte" --source device
  fi
  finish_step memory
}

# torch_row ARGS: bench/gpu/torch_reference.py ARGS (under WITHIN_CAP), its row in the speed step's
# pytorch_rows.jsonl (and its facts), whether it ran or not.
torch_row() {
  local r=$1 log rc=0
  log=$dir/pytorch-$(tr -cs 'A-Za-z0-9' '-' <<<"$r" | sed 's/^-*//; s/-$//').log
  echo "== PyTorch: bench/gpu/torch_reference.py $r"
  if [ -z "$py" ]; then
    echo "no python3 with torch" >"$log"
    rc=127
  else
    within "$py" bench/gpu/torch_reference.py $r >"$log" 2>&1
    rc=$?
  fi
  tail -3 "$log"
  python3 - "$log" "$rc" "$r" "$dir/pytorch_rows.jsonl" <<'PY'
import json, os, sys
log, rc, args, rows = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
a = args.split()
opt = lambda name, default: a[a.index(name) + 1] if name in a else default
row = {"args": args, "label": f"{opt('--flavor', '1B')} b{opt('--batch', '1')} {opt('--ac', 'none')}", "exit_code": rc}
lines = [l for l in open(log, errors="replace") if l.startswith("{")]
if rc == 0 and lines:
    r = json.loads(lines[-1])
    row.update(status="passed", **{k: r[k] for k in ("flavor", "seq", "batch", "ac", "mode", "device", "torch",
                                                       "step_s", "tokens_per_s", "max_reserved_gib") if k in r})
    # DEVICE.md: torchtitan-style PyTorch, Llama 3 1B, seq 8192, batch 1, no AC, on an H200: 44,605 tokens/s.
    if (r.get("flavor"), r.get("batch"), r.get("ac")) == ("1B", 1, "none") and "H200" in r.get("device", ""):
        row["baseline"] = abs(r["tokens_per_s"] / 44605 - 1) <= 0.05
        row["baseline_why"] = f"{r['tokens_per_s']:,.0f} tokens/s against DEVICE.md's 44,605 (within 5% counts)"
else:
    tail = [l.strip() for l in open(log, errors="replace") if l.strip()][-1:] or ["no output"]
    row.update(status="timed_out" if rc in (124, 137) else "failed", why=tail[0][:200])
with open(rows, "a") as f:
    f.write(json.dumps(row) + "\n")
PY
  factj pytorch_rows "$(python3 -c 'import json, sys; print(json.dumps([json.loads(l) for l in open(sys.argv[1])]))' "$dir/pytorch_rows.jsonl")"
}

step_speed() {
  local dir=$out/05-speed big=8B r name
  mkdir -p "$dir"
  : >"$dir/pytorch_rows.jsonl"
  anvil_flags
  # An 80 GB H100 cannot hold 8B with full AC (PyTorch reserves 137 GiB on an H200).
  [[ $gpu == *H100* ]] && big=3B
  # Row: flavor, batch, AC, and the most seconds Anvil's run and PyTorch's may each take, so that a
  # slow one leaves the next its time (the last PyTorch row takes what is left). Each Anvil run
  # goes just before PyTorch's of the same row, which it is compared with.
  local rows=("1B 1 none 25 30" "1B 4 full 30 30" "$big 1 full 35 0")
  for r in "${rows[@]}"; do
    set -- $r
    name=anvil-$1-b$2-$3
    # 5 steps: tokens/s is the median of steps 3-5, after the warm-up of the first two (cuBLASLt's
    # and cuDNN's plans, the device pool's first segments). The op table comes from the same run.
    WITHIN_CAP=$4 train_run "$name" cuda "configs/llama3_${1,,}.toml" "${RUN_FLAGS[@]}" --training.seq_len 8192 \
      --training.local_batch_size "$2" --activation_checkpoint.mode "$3" --training.steps 5 --profiling.op_times \
      --checkpoint.enable false
    [ -n "$gpu" ] && WITHIN_CAP=$5 torch_row "--flavor $1 --seq 8192 --batch $2 --ac $3 --fsdp-single-rank --steps 6 --warmup 2"
    compare "$1 b$2 $3" "$name" speed "$dir/$name" --source device --op-times-to "$dir" \
      --torch "$([ -n "$gpu" ] && tail -1 "$dir/pytorch_rows.jsonl")"
  done
  if [ -z "$gpu" ] && ((rehearse)); then
    # The rehearsal of a row: the same run, parsing, op table and ratios, for the debug model on
    # the CPU beside PyTorch's debug model on the CPU (a check of both scripts, not a baseline).
    train_run anvil-rehearsal cpu configs/debugmodel.toml "${RUN_FLAGS[@]}" --training.seq_len 64 \
      --training.local_batch_size 1 --training.steps 4 --profiling.op_times --checkpoint.enable false
    if [ -n "$py" ]; then
      torch_row "--device cpu --flavor debugmodel --seq 64 --batch 1 --ac none --steps 1 --warmup 1"
    else
      fact pytorch_rows_not_run "no python3 with torch on this machine"
    fi
    compare "debugmodel b1 none (CPU rehearsal)" anvil-rehearsal speed "$dir/anvil-rehearsal" --source host \
      --op-times-to "$dir" --torch "$([ -n "$py" ] && tail -1 "$dir/pytorch_rows.jsonl")"
  fi
  finish_step speed
}

step_sanitizer() {
  local cs
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  if [ -z "$cs" ]; then
    verdict skipped "compute-sanitizer is not on this machine"
    echo "compute-sanitizer is not on this machine"
    return 0
  fi
  [ -n "$gpu" ] || { verdict "$nogpu_status" "no GPU"; return 0; }
  # The kernels of the optimizer test: casts, AdamW and the gradient norm over
  # odd sizes and tails, where an out-of-bounds access would show.
  local filter='CudaCastKernel.*:CudaAdamWKernel.*:CudaGradNormKernel.*'
  fact filter "cuda_optimizer_kernels_test --gtest_filter=$filter"
  packed_within "$cs" --tool memcheck --error-exitcode 1 "$root/bin/cuda_optimizer_kernels_test" \
    --gtest_brief=1 --gtest_filter="$filter" 2>&1 | tee "$STEP_FACTS.out"
  local rc=${PIPESTATUS[0]} ran errors
  ran=$(grep -o '^\[  PASSED  \] [0-9]*' "$STEP_FACTS.out" | grep -o '[0-9]*$')
  errors=$(grep -o 'ERROR SUMMARY: .*' "$STEP_FACTS.out" | tail -1)
  rm -f "$STEP_FACTS.out"
  fact result "memcheck, cuda_optimizer_kernels_test ($filter): ${ran:-0} tests passed; ${errors:-no error summary}; exit $rc"
  ((rc == 0)) || return "$rc"
  # A filter that matches nothing passes silently: hold it to running something.
  ((${ran:-0} > 0)) || { verdict failed "the filter ran no test"; return 1; }
}

step_calibration() {
  local dir=$out/07-calibration hw=h200 seq ok=1
  mkdir -p "$dir"
  [[ $gpu == *H100* ]] && hw=h100-80g
  [ -n "$gpu" ] || ((rehearse)) || { verdict failed "no GPU"; return 1; }
  local run1b=(configs/llama3_1b.toml --hardware "$hw" --gpus 1 --parallelism.fsdp_single_rank true
    --training.local_batch_size 1 --activation_checkpoint.mode none)
  for seq in 2048 8192; do
    echo "== anvil calibrate, 1B seq $seq"
    packed_within "$anvil" calibrate "${run1b[@]}" --training.seq_len $seq --shapes "$dir/shapes-$seq.json" || ok=0
  done
  ((ok)) || { verdict failed "anvil calibrate failed"; return 1; }
  python3 - "$dir/shapes-2048.json" "$dir/shapes-8192.json" "$dir/shapes.json" <<'PY'
import json, sys
merged = {"gemms": [], "attention": []}
for path in sys.argv[1:3]:
    for k, shapes in json.load(open(path)).items():
        merged[k] += [s for s in shapes if s not in merged[k]]
json.dump(merged, open(sys.argv[3], "w"), indent=2)
PY
  local cal=() calpy_why=""
  if [ -z "$py" ]; then
    calpy_why="no python3 with torch"
  elif [ -n "$gpu" ]; then
    # The time left less 20 s for the estimates after it.
    if (($(left) < 60)); then
      calpy_why="$(left) s left: too little for calibrate.py"
    else
      echo "== bench/gpu/calibrate.py ($(($(left) - 20)) s)"
      # --runs 5, not 10: medians of 5 runs, so that it fits the time left after the speed rows.
      timeout -k 5 $(($(left) - 20)) "$py" bench/gpu/calibrate.py --runs 5 --shapes "$dir/shapes.json" \
        --output "$dir/calibration.json" 2>&1 | tee "$dir/calibrate.log"
      local rc=${PIPESTATUS[0]}
      ((rc == 124 || rc == 137)) && { verdict timed_out "calibrate.py ran out of the time left"; return 1; }
      ((rc == 0)) || { verdict failed "calibrate.py exit $rc: $(grep . "$dir/calibrate.log" | tail -1)"; return 1; }
    fi
  else
    # The rehearsal: calibrate.py on the CPU, small sizes, over the debug model's shapes
    # (the 1B's take minutes on a CPU); its file then goes through anvil estimate as on the GPU.
    packed_within "$anvil" calibrate configs/debugmodel.toml --hardware "$hw" --gpus 1 --training.local_batch_size 1 \
      --shapes "$dir/shapes-rehearsal.json" || { verdict failed "anvil calibrate (debug model) failed"; return 1; }
    echo "== bench/gpu/calibrate.py --device cpu (rehearsal)"
    OMP_NUM_THREADS=1 within "$py" bench/gpu/calibrate.py --device cpu --runs 2 --shapes "$dir/shapes-rehearsal.json" \
      --output "$dir/calibration.json" || { verdict failed "calibrate.py --device cpu failed"; return 1; }
  fi
  [ -s "$dir/calibration.json" ] && cal=(--calibration "$dir/calibration.json") && cp "$dir/calibration.json" "$out/calibration.json"
  : >"$dir/estimates.tsv"
  for seq in 2048 8192; do
    local rates
    for rates in published calibrated; do
      [ $rates = calibrated ] && ((${#cal[@]} == 0)) && continue
      echo "== anvil estimate, 1B seq $seq, $rates rates"
      local e with=()
      [ $rates = calibrated ] && with=("${cal[@]}")
      e=$(packed_within "$anvil" estimate "${run1b[@]}" --training.seq_len $seq "${with[@]}" 2>&1) || ok=0
      echo "$e"
      printf '%s\t%s\t%s\t%s\n' $seq $rates "$(grep -o 'tokens/s per GPU: [0-9,.]*' <<<"$e" | grep -o '[0-9][0-9,.]*')" \
        "$(grep '^verdict' <<<"$e" | sed 's/^verdict: //')" >>"$dir/estimates.tsv"
    done
  done
  factj estimates "$(python3 -c '
import json, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
print(json.dumps([{"seq": int(seq), "rates": rates, "tokens_per_s": float(tps.replace(",", "") or "nan"), "verdict": v}
                  for seq, rates, tps, v in rows]))' "$dir/estimates.tsv")"
  [ -s "$dir/calibration.json" ] && factj calibration "$(python3 -c '
import json, sys
c = json.load(open(sys.argv[1]))
print(json.dumps({k: c.get(k) for k in ("device", "torch", "matmul_flops", "hbm_bandwidth")}))' "$dir/calibration.json")"
  fact result "1B estimates $(awk -F'\t' '{printf "%s%s %s: %s tok/s", (NR > 1 ? "; " : ""), $1, $2, $3}' "$dir/estimates.tsv")${calpy_why:+; calibrate.py not run: $calpy_why}"
  ((ok)) || { verdict failed "anvil estimate failed"; return 1; }
  [ -n "$calpy_why" ] && { verdict skipped "calibrate.py not run: $calpy_why"; return 0; }
  return 0
}

export -f one_line fact factj verdict left within packed_within anvil_flags train_run estimate_run anvil_run \
  compare self_test parity_call perturb finish_step torch_row \
  step_unpack step_machine step_op_tests step_parity step_memory step_speed step_sanitizer step_calibration

# ---- the runner ----

steps=()
blocked=""  # set when the pack did not unpack: the later steps have nothing to run
run_step() {  # run_step NN NAME LIMIT FUNCTION (LIMIT 0: what is left)
  local id=$1-$2 limit=$3 fn=$4 rc=0
  local base=$out/$id
  local left=$((budget - reserve - SECONDS))
  ((limit == 0 || limit > left)) && limit=$left
  steps+=("$id")
  local t0
  t0=$(date +%s.%N)
  : >"$base.log"
  if [ -n "$blocked" ]; then
    printf 'skipped\t%s\n' "$blocked" >"$base.verdict"
  elif [ -n "$only" ] && [ "$1" != 00 ] && [[ ,$only, != *,$1,* ]]; then
    printf 'skipped\tnot asked for (--only %s)\n' "$only" >"$base.verdict"
  elif ((limit < 5)); then
    printf 'skipped\tthe %s s budget was spent before this step\n' $budget >"$base.verdict"
  else
    echo "--- $id: started $(date -u +%T), limit $limit s"
    # Sub-commands stop 2 s before the step's own timeout, so the step can still record them.
    STEP_FACTS=$base.facts STEP_VERDICT=$base.verdict STEP_DEADLINE=$(($(date +%s) + limit - 2)) \
      timeout -k 5 "$limit" bash -c "$fn" >"$base.log" 2>&1 </dev/null
    rc=$?
    # What a step stopped at its limit could not delete (finish_step): checkpoints and perturbed
    # copies of runs would swell steps.tar.gz past what the device tool returns.
    rm -rf "$base"/*/checkpoint "$base/copies"
  fi
  python3 - "$base" "$id" "$rc" "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { print b - a }')" "$limit" <<'PY'
import json, os, sys
base, step, rc, secs, limit = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
d = {"step": step, "status": "passed", "exit_code": rc, "seconds": round(secs, 1), "limit_seconds": limit, "why": ""}
facts, bad = {}, []
if os.path.exists(base + ".facts"):
    for line in open(base + ".facts"):
        kind, key, value = line.rstrip("\n").split("\t", 2)
        try:
            facts[key] = json.loads(value) if kind == "j" else value
        except ValueError:
            bad.append(key)
verdict = open(base + ".verdict").read().rstrip("\n").split("\t", 1) if os.path.exists(base + ".verdict") else None
log = [l.strip() for l in open(base + ".log", errors="replace") if l.strip()]
if rc in (124, 137):
    d.update(status="timed_out", why=f"stopped at its {limit} s limit" + (f" ({verdict[1]})" if verdict else ""))
elif verdict:
    d.update(status=verdict[0], why=verdict[1] or "no reason given")
    if d["status"] not in ("failed", "skipped"):
        d.update(status="failed", why=f"the step gave an unknown status {verdict[0]!r}")
elif rc != 0:
    d.update(status="failed", why=f"exit {rc}: " + (log[-1][:200] if log else "no output"))
if bad:
    d.update(status="failed", why=f"the step's facts {', '.join(bad)} are not JSON")
d.update({k: v for k, v in facts.items() if k not in d})
with open(base + ".json", "w") as f:
    json.dump(d, f, indent=2)
for ext in (".facts", ".verdict"):
    if os.path.exists(base + ext):
        os.remove(base + ext)
PY
  local line
  line=$(python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); print(d["status"], "in", d["seconds"], "s" + (": " + d["why"] if d["why"] else ""))' "$base.json" 2>&1)
  echo "--- $id: $line"
  case $line in passed*) ;; *) tail -4 "$base.log" | sed 's/^/    | /' ;; esac
}

run_step 00 unpack 60 step_unpack
python3 -c 'import json, sys; sys.exit(json.load(open(sys.argv[1]))["status"] != "passed")' "$out/00-unpack.json" 2>/dev/null ||
  blocked="the pack did not unpack"
run_step 01 machine 15 step_machine
run_step 02 op-tests 45 step_op_tests
run_step 03 parity 90 step_parity
run_step 04 memory 30 step_memory
run_step 05 speed 150 step_speed
run_step 06 sanitizer 30 step_sanitizer
run_step 07 calibration 0 step_calibration

# ---- the summary: every step's JSON checked, summary.json and summary.md, the table last ----

python3 - "$out" "$rehearse" "$pack" "$SECONDS" "$budget" "${steps[@]}" <<'PY'
import json, os, sys
out, rehearse, pack, secs, budget, steps = sys.argv[1], sys.argv[2] == "1", sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6:]
allowed = ("passed", "failed", "skipped", "timed_out")
rows, bad = [], []
for s in steps:
    try:
        d = json.load(open(os.path.join(out, s + ".json")))
        assert d["step"] == s and d["status"] in allowed, "step or status"
        assert isinstance(d["exit_code"], int) and isinstance(d["seconds"], (int, float)) and isinstance(d["limit_seconds"], int), "types"
        assert isinstance(d["why"], str) and (d["status"] == "passed") == (d["why"] == ""), "why"
    except Exception as e:
        bad.append(s)
        d = {"step": s, "status": "failed", "exit_code": -1, "seconds": 0, "limit_seconds": 0,
             "why": f"its JSON is missing or malformed ({type(e).__name__}: {e})"}
    rows.append(d)
failed = [d["step"] for d in rows if d["status"] in ("failed", "timed_out")]
summary = {
    "mode": "rehearsal" if rehearse else "gpu", "pack": pack, "seconds": secs, "budget_seconds": budget,
    "result": "failed" if failed else "passed", "exit_code": 1 if failed else 0, "failed_steps": failed,
    "malformed_steps": bad, "counts": {s: sum(d["status"] == s for d in rows) for s in allowed}, "steps": rows,
}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)
cell = lambda s: str(s).replace("|", "/").replace("\n", " ")[:240]
md = [f"GPU check ({summary['mode']}): {summary['result']} in {secs} s of {budget} s", "",
      "| step | status | seconds | result |", "|---|---|---|---|"]
for d in rows:
    res = d.get("result", "") if d["status"] == "passed" else "; ".join(x for x in (d["why"], d.get("result")) if x)
    md.append(f"| {d['step']} | {d['status']} | {d['seconds']} | {cell(res)} |")
open(os.path.join(out, "summary.md"), "w").write("\n".join(md) + "\n")
PY
rc=$?
# The step files in one archive: the device tool returns at most 8 files from $OUT.
(cd "$out" && tar -czf steps.tar.gz [0-9][0-9]-* && rm -rf [0-9][0-9]-*) || { echo "check.sh: cannot archive the step files"; rc=1; }
echo "check.sh: files in $out: $(cd "$out" && ls | tr '\n' ' ')"
echo
if [ -s "$out/summary.md" ]; then
  ((rc)) || rc=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["exit_code"])' "$out/summary.json")
  cat "$out/summary.md"
else
  echo "check.sh: no summary (the summary's python failed)"
  rc=1
fi
# tee's last lines are the table: wait for them (the device tool ends what a command leaves running).
exec >&3 2>&4
wait "$tee_pid"
exit "$rc"
