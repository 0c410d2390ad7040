# Sourced by scripts/setup.sh and scripts/setup_oracles.sh: a virtual
# environment of the project's own (the system Python is never touched) with
# pinned PyPI packages, fetched only when one is missing or another version.
#
#   ensure_venv TAG DIR NAME==VERSION ...
ensure_venv() {
  local tag=$1 venv=$2
  shift 2
  if [ ! -x "$venv/bin/python" ]; then
    echo "$tag: creating the virtual environment $venv"
    /usr/bin/python3 -m venv "$venv"
  fi
  if "$venv/bin/python" - "$@" <<'PY' 2>/dev/null; then
import sys
from importlib.metadata import version
sys.exit(any(version(n) != v for n, v in (p.split("==") for p in sys.argv[1:])))
PY
    echo "$tag: $venv has $*"
  else
    echo "$tag: installing $* into $venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "$@"
  fi
}
