#!/usr/bin/env bash
# The kernels' code budget on the GPU Anvil trains on (sm_90a): no kernel may
# spill registers or keep anything in local memory (a stack frame), since both
# go through the memory hierarchy and silently cost a memory-bound kernel much
# of its bandwidth. Compiles each ops/cuda/*.cu for sm_90a alone with ptxas's
# report (-Xptxas -v) and fails, naming the kernel and its figures, when a
# stack frame, a spill or local memory (lmem) is reported; warnings are errors,
# as in the build (a host-only call in device code only warns, and compiles the
# kernel to nothing). The toolkit here carries no cuobjdump to read the built
# library, hence the compile.
# Usage: kernel_budget_check.sh NVCC SOURCE_DIR FILE.cu...
set -euo pipefail
nvcc=$1 src=$2
shift 2
(($# > 0)) || { echo "kernel_budget_check: no .cu files given" >&2; exit 2; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
status=0 kernels=0 files=0
for cu in "$@"; do
  "$nvcc" -std=c++20 -arch=sm_90a --cubin -Xptxas -v -Werror=all-warnings -DANVIL_CUDA -I"$src" -o "$scratch/k.cubin" "$cu" \
    >"$scratch/report" 2>&1 || { cat "$scratch/report"; echo "kernel_budget_check: $cu did not compile" >&2; exit 2; }
  # ptxas names each function, then gives its frame and spills, then its registers (and lmem, when any).
  if ! awk -v file="$(basename "$cu")" '
    /Compiling entry function/ { match($0, /'\''[^'\'']+'\''/); fn = substr($0, RSTART + 1, RLENGTH - 2); kernels++ }
    /Function properties for/ { fn = $NF }
    /bytes stack frame/ {
      if ($1 + 0 > 0 || $5 + 0 > 0 || $9 + 0 > 0) { print file ": " fn ": " $0; bad = 1 }
    }
    /bytes lmem/ { match($0, /[0-9]+ bytes lmem/); if (substr($0, RSTART) + 0 > 0) { print file ": " fn ": " $0; bad = 1 } }
    /Used [0-9]+ registers/ { sub(/^.*: /, ""); printf "  %s: %s: %s\n", file, fn, $0 }
    END { print kernels + 0 > "/dev/stderr"; exit bad }' "$scratch/report" 2>"$scratch/count"; then
    status=1
  fi
  kernels=$((kernels + $(cat "$scratch/count")))
  files=$((files + 1))
done
# Every file read to its end (a file without kernels once ended the loop early, unnoticed).
((files == $#)) || { echo "kernel_budget_check: read $files of $# files" >&2; exit 2; }
((kernels > 0)) || { echo "kernel_budget_check: ptxas reported no kernels" >&2; exit 2; }
if ((status)); then
  echo "kernel_budget_check: FAILED: the kernels above spill or use local memory on sm_90a"
else
  echo "kernel_budget_check: $kernels kernels in $# files: no spills, no stack frame, no local memory on sm_90a"
fi
exit $status
