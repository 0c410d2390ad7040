#!/usr/bin/env bash
# Renders a run's report and photographs it in headless Chromium:
#   scripts/report_screenshot.sh <dump_folder> <out.png> [extra anvil report options]
# Builds build/anvil if it is missing. The page is 1280 px wide; 2600 px tall
# holds every chart of a run with a step trace and a memory snapshot.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 <dump_folder> <out.png> [--trace-step N]" >&2
  exit 2
fi
dump=$1
out=$2
shift 2
root="$(cd "$(dirname "$0")/.." && pwd)"
command -v chromium >/dev/null || { echo "$0: chromium is not installed (scripts/setup.sh installs it)" >&2; exit 1; }
if [ ! -x "$root/build/anvil" ]; then
  cmake -S "$root" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  ninja -C "$root/build" anvil
fi

html="$(mktemp -d)/report.html"
"$root/build/anvil" report "$dump" --output "$html" "$@" >/dev/null
# A private profile, so a Chromium already open (or another run of this script) is not disturbed;
# Chromium's stderr is D-Bus and GPU noise in a headless session.
profile="$(dirname "$html")/chromium-profile"
timeout 180 chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir="$profile" \
  --window-size=1280,2600 --screenshot="$(realpath -m "$out")" "file://$html" 2>/dev/null
rm -rf "$(dirname "$html")"
[ -s "$out" ] || { echo "$0: chromium wrote no screenshot" >&2; exit 1; }
echo "$out"
