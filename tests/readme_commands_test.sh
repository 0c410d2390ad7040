#!/usr/bin/env bash
# Every command in the README's ```sh blocks is run by something, so that none
# can go stale unseen. Each command is one of:
#  (a) the two commands under "## The two commands", which
#      scripts/fresh_debian_check.sh runs verbatim in a fresh Debian 12 root
#      (CI, .ci/run, runs its --tests half: checked); checked here to be what that
#      script parses from the README;
#  (b) an anvil command (`build/anvil ...`, alone, after `echo ... |`, or under
#      `mpirun` with at most 2 ranks), run here for real, in README order, in a
#      scratch folder laid out as `scripts/setup.sh && scripts/train.sh` leave a
#      checkout: build/anvil (the binary given), configs/, a corpus in
#      data/shakespeare/{train,validation} and its tokenizer in
#      data/tokenizers/shakespeare-2048/. The corpus is a stand-in, this
#      repository's own docs/*.md, so the test needs no network. A training
#      command must be cheap as the README writes it (`--training.steps N`,
#      N <= 20); nothing is appended to it;
#  (c) listed in ELSEWHERE below: it needs what this test lacks (the CUDA
#      toolkit), and the CI script named there runs it (checked to still do so).
# A command that is none of these, or that exits non-zero, fails the test with
# the command, its output and what to do.
#
#   tests/readme_commands_test.sh ANVIL_BINARY [README.md]
# (ctest: Readme.EveryCommandIsRunByATestOrCI.) ANVIL_KEEP_TEST_FILES=1 keeps
# the scratch folder.
set -uo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
anvil=$(readlink -f "$1")
readme=$(readlink -f "${2:-$repo/README.md}")
[ -x "$anvil" ] || { echo "readme_commands_test: '$1' is not an executable anvil binary" >&2; exit 2; }
[ -f "$readme" ] || { echo "readme_commands_test: '$readme' not found" >&2; exit 2; }

# (c): ERE matched against a command (its trailing comment removed) | the CI
# script that runs it | a line that script must still contain. Keep this short.
ELSEWHERE=(
  '^cmake -S \. -B build-cuda .*-DANVIL_CUDA=ON|.ci/run|cmake -S . -B build-cuda -G Ninja -DANVIL_CUDA=ON'
)
MAX_TRAIN_STEPS=20
TIMEOUT_S=300  # per command

# The README's commands: every non-blank, non-comment line of each ```sh
# block, backslash continuations joined; one a line.
mapfile -t commands < <(awk '
  /^[[:space:]]*```sh[[:space:]]*$/ { in_block = 1; next }
  in_block && /^[[:space:]]*```/ { in_block = 0; next }
  !in_block { next }
  { line = $0
    if (cont != "") { line = cont " " line; cont = "" }
    if (line ~ /\\[[:space:]]*$/) { sub(/[[:space:]]*\\[[:space:]]*$/, "", line); cont = line; next }
    if (line ~ /^[[:space:]]*(#.*)?$/) next
    sub(/^[[:space:]]+/, "", line)
    print line }' "$readme")
if [ "${#commands[@]}" -eq 0 ]; then
  echo "readme_commands_test: no commands found in ${readme}'s \`\`\`sh blocks" >&2
  exit 1
fi

# (a): what scripts/fresh_debian_check.sh parses from this README.
mapfile -d '' main_commands < <("$repo/scripts/fresh_debian_check.sh" --print-commands "$readme")
if [ "${#main_commands[@]}" -ne 2 ]; then
  echo "FAIL: scripts/fresh_debian_check.sh --print-commands found ${#main_commands[@]} commands, not 2, under" \
       "\"## The two commands\" in $readme; keep that section's two \`\`\`sh blocks, one command each" >&2
  exit 1
fi

if ! grep -qF 'scripts/fresh_debian_check.sh --tests' "$repo/.ci/run"; then
  echo "FAIL: .ci/run no longer runs scripts/fresh_debian_check.sh --tests, which runs the README's test command" >&2
  exit 1
fi

# A command's trailing comment starts after two or more spaces, as the README writes them.
without_comment() { sed -E 's/[[:space:]]{2,}#.*$//' <<<"$1"; }

# The scratch checkout for (b).
scratch=$(mktemp -d "${TMPDIR:-/tmp}/anvil-readme.XXXXXX")
if [ -z "${ANVIL_KEEP_TEST_FILES:-}" ]; then trap 'rm -rf "$scratch"' EXIT; else echo "scratch: $scratch"; fi
mkdir -p "$scratch/build" "$scratch/data/shakespeare/train" "$scratch/data/shakespeare/validation" \
         "$scratch/data/tokenizers/shakespeare-2048"
ln -s "$anvil" "$scratch/build/anvil"
ln -s "$repo/configs" "$scratch/configs"
i=0
for f in "$repo"/docs/*.md; do  # every fourth page held out, as prepare_data.sh holds out works
  split=train; ((i++ % 4 == 3)) && split=validation
  cp "$f" "$scratch/data/shakespeare/$split/$(basename "$f" .md).txt"
done
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
if [ "$(id -u)" -eq 0 ]; then  # the README: as root, Open MPI needs these
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# As scripts/train.sh makes the main job's tokenizer.
if ! (cd "$scratch" && build/anvil tokenizer train --input data/shakespeare/train --vocab-size 2048 \
        --output data/tokenizers/shakespeare-2048/tokenizer.json) >"$scratch/setup.log" 2>&1; then
  echo "readme_commands_test: could not make the stand-in corpus's tokenizer:" >&2
  cat "$scratch/setup.log" >&2
  exit 1
fi

failures=0 n_main=0 n_run=0 n_elsewhere=0
fail() {  # fail COMMAND WHY...
  local cmd=$1; shift
  printf 'FAIL      %s\n          %s\n' "$cmd" "$*"
  failures=$((failures + 1))
}

for cmd in "${commands[@]}"; do
  bare=$(without_comment "$cmd")
  # (a)
  if [ "$bare" = "${main_commands[0]}" ] || [ "$bare" = "${main_commands[1]}" ]; then
    printf 'ok (a)    %s   [run verbatim by scripts/fresh_debian_check.sh]\n' "$bare"
    n_main=$((n_main + 1))
    continue
  fi
  # (c)
  matched=
  for entry in "${ELSEWHERE[@]}"; do
    IFS='|' read -r pattern script must_contain <<<"$entry"
    [[ $bare =~ $pattern ]] || continue
    matched=1
    if grep -qF -- "$must_contain" "$repo/$script"; then
      printf 'ok (c)    %s   [run by %s]\n' "$bare" "$script"
      n_elsewhere=$((n_elsewhere + 1))
    else
      fail "$cmd" "ELSEWHERE in $0 says $script runs this, but $script no longer contains '$must_contain';" \
           "make $script run it again, or correct the entry"
    fi
    break
  done
  [ -n "$matched" ] && continue
  # (b): only anvil commands, and only cheap ones as written.
  core=$bare
  if [[ $core =~ ^echo\ [^|]*\|\ *(.*)$ ]]; then core=${BASH_REMATCH[1]}; fi
  if [[ $core =~ ^mpirun\ .*-np\ ([0-9]+)\ (.*)$ ]]; then
    if ((BASH_REMATCH[1] > 2)); then
      fail "$cmd" "mpirun with ${BASH_REMATCH[1]} ranks is more than this test runs (2);" \
           "use -np 2 in the README, move the command to docs/, or add it to ELSEWHERE in $0 with the CI script that runs it"
      continue
    fi
    core=${BASH_REMATCH[2]}
    [[ $core =~ ^build/anvil\  ]] || core=  # only `mpirun <options> -np N build/anvil ...`
  fi
  if [[ ! $core =~ ^build/anvil(\ |$) ]]; then
    fail "$cmd" "neither one of the two commands, nor an anvil command this test runs, nor listed in ELSEWHERE;" \
         "write it as a cheap build/anvil command, move it to a docs/ page, or add it to ELSEWHERE in $0" \
         "naming the CI script that runs it"
    continue
  fi
  if [[ $core =~ (\&\&|\|\||;) ]]; then
    fail "$cmd" "one anvil command a line: this test runs a line only when it is one anvil command (split it)"
    continue
  fi
  if [[ $core =~ ^build/anvil\ train\  ]] && [[ ! $core =~ (^|\ )--help(\ |$) ]]; then
    if [[ ! $core =~ --training\.steps[\ =]([0-9]+) ]] || ((BASH_REMATCH[1] > MAX_TRAIN_STEPS)); then
      fail "$cmd" "a training command must be cheap as the README writes it: give it --training.steps N" \
           "with N <= $MAX_TRAIN_STEPS (this test appends nothing), or move it to a docs/ page"
      continue
    fi
  fi
  t0=$(date +%s.%N)
  log=$scratch/command-$((n_run + failures)).log
  (cd "$scratch" && timeout -k 5 "$TIMEOUT_S" bash -c "set -eo pipefail; $cmd") </dev/null >"$log" 2>&1
  rc=$?
  dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  if ((rc == 0)); then
    printf 'ok (b)    %s   [ran here: exit 0, %s s]\n' "$bare" "$dt"
    n_run=$((n_run + 1))
  else
    fail "$cmd" "ran here in $scratch and exited $rc after $dt s$( ((rc == 124)) && echo " (the ${TIMEOUT_S} s limit)");" \
         "fix the README command or the program (ANVIL_KEEP_TEST_FILES=1 keeps the folder). Its output's end:"
    tail -n 25 "$log" | sed 's/^/          | /'
  fi
done

total=${#commands[@]}
echo "readme_commands_test: $total commands in $(basename "$readme"): $n_main run by scripts/fresh_debian_check.sh," \
     "$n_run run here, $n_elsewhere run by CI scripts (ELSEWHERE); $failures failed"
((failures == 0))
