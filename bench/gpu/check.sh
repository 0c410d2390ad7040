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
#   bench/gpu/check.sh [--rehearse] [--out DIR] [PACK]
#
# PACK: bench/gpu/pack.sh's archive (default .gpu/anvil-gpu.tar.xz).
# DIR:  $OUT when set (the device tool's output folder), else /tmp/anvil-gpu-check.
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
#   03 parity     90  GPU training against the CPU's      } not built yet: each
#   04 memory     30  GPU peaks against the dry run's     } records the commands
#   05 speed     150  Anvil rows beside PyTorch's rows    } it will run; speed
#                     runs PyTorch's rows (bench/gpu/torch_reference.py) now
#   06 sanitizer  30  compute-sanitizer memcheck on a few op tests
#   07 calibration    the time left: anvil calibrate, bench/gpu/calibrate.py, anvil estimate
#
# Each step writes DIR/<nn>-<step>.log (its whole output) and DIR/<nn>-<step>.json:
#   {"step", "status": passed|failed|skipped|timed_out|not_built, "exit_code",
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
# unpacked and its binaries are loaded, run and their output parsed.
# Exit status: 1 if a step failed or timed out, or a step's JSON is missing or
# malformed (skipped and not_built steps do not fail the check); else 0.
set -uo pipefail

usage() { sed -n '11,18p' "$0" | sed 's/^# \{0,1\}//'; }
rehearse=0
out=
pack=
while (($#)); do
  case $1 in
    --rehearse) rehearse=1 ;;
    --out) out=${2:?--out needs a folder}; shift ;;
    --out=*) out=${1#--out=} ;;
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
# planned PROVES CMD...: a command a step will run once the GPU trainer exists,
# printed and kept in the step's JSON as will_run.
planned() {
  local proves=$1
  shift
  printf '  will run: %s\n    proves: %s\n' "$*" "$proves"
  printf '%s\t%s\n' "$*" "$proves" >>"$STEP_FACTS.plan"
}
record_plan() {
  factj will_run "$(python3 -c '
import json, sys
print(json.dumps([dict(zip(("command", "proves"), l.rstrip("\n").split("\t", 1))) for l in open(sys.argv[1])]))' "$STEP_FACTS.plan")"
  rm -f "$STEP_FACTS.plan"
}
# not_built_unless KIND: the step's Anvil part needs the GPU trainer (`anvil train
# --job.device cuda`) or the GPU dry run (`anvil estimate --job.device cuda`).
# Today neither exists: not_built. Once one does, the step fails until its run
# (the planned commands and their comparison) is written here.
not_built_unless() {
  local probe
  if [ "$1" = trainer ]; then
    probe=$(packed_within "$anvil" train --help 2>&1) || { verdict failed "anvil train --help failed: $(tail -1 <<<"$probe")"; return 1; }
    grep -q -- '--job.device ' <<<"$probe" || { verdict not_built "anvil train has no job.device (the trainer does not run on a GPU yet)"; return 0; }
  else
    probe=$(packed_within "$anvil" estimate configs/debugmodel.toml --job.device cuda 2>&1)
    if grep -q "unknown key 'job.device'" <<<"$probe"; then
      verdict not_built "anvil estimate has no job.device (no GPU dry run yet)"
      return 0
    fi
  fi
  verdict failed "Anvil now has job.device: write this step's run of the will_run commands in bench/gpu/check.sh"
  return 1
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
  local m dir=$out/03-parity
  # The same 10 steps on the GPU and on the CPU, fp32 with TF32 off (cuBLASLt's
  # CUBLAS_COMPUTE_32F), deterministic, from the same seed; data from the pack.
  for m in debugmodel llama3_25m; do
    local run=(anvil train "configs/$m.toml" --training.steps 10 --training.seed 0 --training.deterministic
      --metrics.log_freq 1 --checkpoint.enable --checkpoint.interval 10 --checkpoint.last_save_model_only)
    planned "fp32 $m: each step's loss and gradient norm within 1e-5 relative of the CPU's; final weights within 1e-5 of the largest weight (llama3_25m: GQA)" \
      "${run[@]}" --training.mixed_precision_param float32 --job.device cuda --job.dump_folder "$dir/$m-fp32-cuda" \
      "&&" "${run[@]}" --training.mixed_precision_param float32 --job.device cpu --job.dump_folder "$dir/$m-fp32-cpu"
    planned "bf16 $m: the GPU's loss gap to its fp32 run at most twice the CPU's gap to its fp32 run" \
      "${run[@]}" --training.mixed_precision_param bfloat16 --job.device cuda --job.dump_folder "$dir/$m-bf16-cuda" \
      "&&" "${run[@]}" --training.mixed_precision_param bfloat16 --job.device cpu --job.dump_folder "$dir/$m-bf16-cpu"
  done
  local ac
  for ac in "selective --activation_checkpoint.selective_ac_option op" "selective --activation_checkpoint.selective_ac_option 2" full; do
    planned "AC $ac on the GPU: losses, gradient norms and weights as the fp32 GPU run without AC (the same bounds)" \
      anvil train configs/llama3_25m.toml --training.steps 10 --training.mixed_precision_param float32 --job.device cuda \
      --activation_checkpoint.mode $ac --job.dump_folder "$dir/llama3_25m-ac-${ac%% *}"
  done
  planned "gradient accumulation 2 on the GPU: as one batch of twice the size, within the fp32 bounds" \
    anvil train configs/llama3_25m.toml --training.steps 10 --training.mixed_precision_param float32 --job.device cuda \
    --training.local_batch_size 4 --training.global_batch_size 8 --job.dump_folder "$dir/llama3_25m-accum2"
  record_plan
  not_built_unless trainer
}

step_memory() {
  local run=(configs/llama3_1b.toml --training.seq_len 8192 --training.local_batch_size 1
    --parallelism.fsdp_single_rank true --activation_checkpoint.mode none --job.device cuda)
  planned "the dry run's per-category peaks (weights, gradients, optimizer state, activations, workspace) and reserved bytes, on the device pool over a fake device" \
    anvil estimate "${run[@]}"
  planned "each category's measured peak equals the dry run's to the byte; the pool's reserved bytes within 2% of the dry run's" \
    anvil train "${run[@]}" --training.steps 3 --profiling.enable_memory_snapshot --job.dump_folder "$out/04-memory/1b"
  record_plan
  not_built_unless estimate
}

step_speed() {
  local dir=$out/05-speed big=8B
  mkdir -p "$dir"
  # An 80 GB H100 cannot hold 8B with full AC (PyTorch reserves 137 GiB on an H200).
  [[ $gpu == *H100* ]] && big=3B
  # Row: flavor, batch, AC, and the most seconds its PyTorch run may take, so
  # that a slow row leaves the next its time (the last takes what is left).
  local rows=("1B 1 none 40" "1B 4 full 50" "$big 1 full 0") r
  for r in "${rows[@]}"; do
    set -- $r
    planned "Llama 3 $1, seq 8192, batch $2, AC $3: tokens/s, reserved memory and the op table, beside PyTorch's row in this run" \
      anvil train "configs/llama3_${1,,}.toml" --job.device cuda --training.seq_len 8192 --training.local_batch_size "$2" \
      --activation_checkpoint.mode "$3" --training.steps 8 --metrics.log_freq 1 --profiling.op_times --job.dump_folder "$dir/anvil-$1-b$2-$3"
  done
  record_plan
  local anvil_rc=0
  not_built_unless trainer || anvil_rc=1
  # PyTorch's rows run now: the baseline each Anvil row will stand beside.
  local torch_rows=() caps=() how
  if [ -n "$gpu" ]; then
    for r in "${rows[@]}"; do
      set -- $r
      torch_rows+=("--flavor $1 --seq 8192 --batch $2 --ac $3 --fsdp-single-rank --steps 6 --warmup 2")
      caps+=("$4")
    done
    how=gpu
  elif ((rehearse)) && [ -n "$py" ]; then
    # The rehearsal of the rows: the same script and parsing, a tiny model on the CPU.
    torch_rows=("--device cpu --flavor debugmodel --seq 64 --batch 1 --ac none --steps 1 --warmup 1")
    caps=(0)
    how=rehearsal
  fi
  : >"$dir/pytorch_rows.jsonl"
  local i
  for i in "${!torch_rows[@]}"; do
    r=${torch_rows[$i]}
    local log rc=0
    log=$dir/pytorch-$(tr -cs 'A-Za-z0-9' '-' <<<"$r" | sed 's/^-*//; s/-$//').log
    echo "== PyTorch: bench/gpu/torch_reference.py $r"
    if [ -z "$py" ]; then
      echo "no python3 with torch" >"$log"
      rc=127
    else
      WITHIN_CAP=${caps[$i]} within "$py" bench/gpu/torch_reference.py $r >"$log" 2>&1
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
  done
  local summary rows_ok=0
  summary=$(python3 - "$dir/pytorch_rows.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
parts = []
for r in rows:
    if r["status"] == "passed":
        mem = f", {r['max_reserved_gib']:.1f} GiB" if "max_reserved_gib" in r else ""
        base = {True: " (baseline)", False: " (not a baseline: >5% off DEVICE.md)"}.get(r.get("baseline"), "")
        parts.append(f"{r['label']} {r['tokens_per_s']:,.0f} tok/s{mem}{base}")
    else:
        parts.append(f"{r['label']} {r['status']}: {r['why'][:80]}")
print("PyTorch " + ("; ".join(parts) if parts else "rows not run"))
sys.exit(any(r["status"] != "passed" for r in rows))
PY
  ) || rows_ok=1
  fact result "$summary$([ "$how" = rehearsal ] && echo ' (CPU rehearsal)')"
  ((anvil_rc)) && return 1
  ((rows_ok == 0)) || { verdict failed "a PyTorch row failed (${dir##*/}/pytorch-*.log)"; return 1; }
  if [ -z "$how" ]; then
    ((rehearse)) && { verdict skipped "no GPU, and no python3 with torch for the rows' CPU rehearsal"; return 0; }
    verdict failed "no GPU: PyTorch's rows not run"
    return 1
  fi
  return 0
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

export -f one_line fact factj verdict left within packed_within planned record_plan not_built_unless \
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
  elif ((limit < 5)); then
    printf 'skipped\tthe %s s budget was spent before this step\n' $budget >"$base.verdict"
  else
    echo "--- $id: started $(date -u +%T), limit $limit s"
    # Sub-commands stop 2 s before the step's own timeout, so the step can still record them.
    STEP_FACTS=$base.facts STEP_VERDICT=$base.verdict STEP_DEADLINE=$(($(date +%s) + limit - 2)) \
      timeout -k 5 "$limit" bash -c "$fn" >"$base.log" 2>&1 </dev/null
    rc=$?
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
    if d["status"] not in ("failed", "skipped", "not_built"):
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
allowed = ("passed", "failed", "skipped", "timed_out", "not_built")
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
