#!/usr/bin/env bash
# Proves the README's two commands work on a fresh Debian 12: builds a minimal
# Debian 12 root with debootstrap, clones this checkout's committed HEAD into
# it, and runs the commands exactly as the README's "The two commands" section
# writes them, as root in a chroot. Nothing the host has installed can help:
# a missing install step fails here.
#
#   scripts/fresh_debian_check.sh            both commands (main, then tests)
#   scripts/fresh_debian_check.sh --main     setup + train only
#   scripts/fresh_debian_check.sh --tests    setup + tests only
# Options: --steps N (training steps appended to the main command; 20),
#          --keep (leave the root for inspection and print where it is),
#          --refresh (rebuild the cached pristine root).
#   scripts/fresh_debian_check.sh --print-commands [README.md]
#          print the two commands as parsed from the README (each ended by a NUL
#          byte) and exit; needs nothing (tests/readme_commands_test.sh uses it).
# Needs root and debootstrap (installed with apt-get when missing). The
# pristine root is cached as a tarball in /var/cache/anvil-fresh-root/
# (ANVIL_FRESH_CACHE overrides); each run unpacks a throw-away copy under
# /var/tmp. CI, when set, is passed into the root (tests then fail instead of
# skipping). The oracles' environment (scripts/setup_oracles.sh), where the
# host has one, is mounted read-only at the same path in the root, as the
# machine's cache outside the checkout: the root's tests use it, and nothing
# in the root can change it.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

run_main=0 run_tests=0 steps=20 keep=0 refresh=0 inner= print_only=0 readme=
while (($#)); do
  case $1 in
    --main) run_main=1 ;;
    --tests) run_tests=1 ;;
    --steps) steps=${2:?--steps needs a number}; shift ;;
    --keep) keep=1 ;;
    --refresh) refresh=1 ;;
    --print-commands) print_only=1; if [ -n "${2:-}" ] && [[ $2 != --* ]]; then readme=$2; shift; fi ;;
    --inner) inner=${2:?}; shift ;;  # internal: the part that runs in a private mount namespace
    -h|--help) usage; exit 0 ;;
    *) echo "fresh_debian_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
((run_main || run_tests)) || { run_main=1; run_tests=1; }

# ---------------------------------------------------------------------------
# Inner part: runs under `unshare --mount --propagation private`, so every mount
# below lives in a private mount namespace. Nothing propagates to the host, and
# the kernel drops all of them when this process ends, however it ends; the
# trap only unmounts early for tidiness.
if [ -n "$inner" ]; then
  root=$inner
  cleanup_mounts() {  # every mount below sits on the root's own bind mount
    umount -R "$root" 2>/dev/null || umount -R -l "$root" 2>/dev/null || true
  }
  trap cleanup_mounts EXIT
  # The root a mount point of its own, as / is on a real machine: `ip netns
  # exec` and `ip -n` (the multi-host tests' hosts) remount / as a slave,
  # which fails on a plain directory.
  mount --bind "$root" "$root"
  mount -t proc proc "$root/proc"
  mount --rbind /sys "$root/sys"
  mount --rbind /dev "$root/dev"        # includes /dev/pts
  # OpenMPI's shared-memory transport (the tests run mpirun) needs a writable
  # /dev/shm; a tmpfs of the root's own keeps its segments off the host's.
  mkdir -p "$root/dev/shm"
  mount -t tmpfs -o mode=1777,nosuid,nodev shm "$root/dev/shm"
  if [ -n "${ORACLES:-}" ]; then
    mkdir -p "$root$ORACLES"
    mount --bind "$ORACLES" "$root$ORACLES"
    mount -o remount,bind,ro "$root$ORACLES"
  fi

  status=0
  run() {  # run NAME COMMAND: in the root, as root, with a clean login-like environment
    local name=$1 cmd=$2 env=(HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
                              LANG=C.UTF-8 TERM="${TERM:-dumb}")
    [ -n "${CI:-}" ] && env+=(CI="$CI")
    [ -n "${ORACLES:-}" ] && env+=(ANVIL_ORACLES="$ORACLES")
    # The network's settings for pip (index, proxy, certificates), as the
    # outer part found them on the host.
    local v
    for v in ${PASS_ENV:-}; do env+=("$v=${!v}"); done
    echo "fresh_debian_check: [$name] $cmd"
    local t0=$SECONDS rc=0
    chroot "$root" /usr/bin/env -i "${env[@]}" /bin/bash -c "cd /root/anvil && $cmd" || rc=$?
    local dt=$((SECONDS - t0))
    printf 'fresh_debian_check: [%s] exit %d after %dm%02ds\n' "$name" "$rc" $((dt / 60)) $((dt % 60))
    echo "$name $rc $dt" >>"$root/../times"
    ((rc == 0)) || status=1
  }
  [ -n "${MAIN_CMD:-}" ] && run main "$MAIN_CMD"
  [ -n "${TEST_CMD:-}" ] && run tests "$TEST_CMD"
  exit $status
fi

# ---------------------------------------------------------------------------
# Outer part: on the host.
self=$(readlink -f "$0")
repo=$(dirname "$(dirname "$self")")

# The README's commands, read from its "The two commands" section so the check
# cannot drift from what users are told: the first ```sh block is the main job,
# the second the tests.
mapfile -t cmds < <(awk '
  /^## / { in_section = ($0 ~ /^## The two commands/) }
  in_section && /^```sh$/ { in_block = 1; next }
  in_section && in_block && /^```$/ { in_block = 0; print cmd; cmd = ""; next }
  in_section && in_block { cmd = (cmd == "" ? $0 : cmd "\n" $0) }' "${readme:-$repo/README.md}")
if [ "${#cmds[@]}" -ne 2 ]; then
  echo "fresh_debian_check: expected two \`\`\`sh blocks under \"## The two commands\" in README.md, found ${#cmds[@]}" >&2
  exit 1
fi
if ((print_only)); then
  printf '%s\0' "${cmds[@]}"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "fresh_debian_check: needs root (debootstrap, mount, chroot); run it with sudo" >&2
  exit 1
fi
main_cmd="${cmds[0]} --training.steps $steps"
test_cmd=${cmds[1]}

# The pristine root, cached.
cache_dir=${ANVIL_FRESH_CACHE:-/var/cache/anvil-fresh-root}
cache=$cache_dir/bookworm-minbase.tar
if ((refresh)) || [ ! -s "$cache" ]; then
  command -v debootstrap >/dev/null || {
    echo "fresh_debian_check: installing debootstrap"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap
  }
  mkdir -p "$cache_dir"
  build=$(mktemp -d "$cache_dir/build.XXXXXX")
  chmod 755 "$build"  # it becomes the root's /; mktemp makes it 0700, which locks out _apt and other users
  trap 'rm -rf --one-file-system "$build"' EXIT
  echo "fresh_debian_check: debootstrap --variant=minbase bookworm (cached in $cache)"
  t0=$SECONDS
  debootstrap --variant=minbase bookworm "$build" >"$build.log" 2>&1 || {
    tail -20 "$build.log" >&2; echo "fresh_debian_check: debootstrap failed; log in $build.log" >&2; exit 1; }
  tar -C "$build" --numeric-owner -cf "$cache.tmp" . && mv "$cache.tmp" "$cache"
  rm -rf --one-file-system "$build" "$build.log"
  trap - EXIT
  echo "fresh_debian_check: pristine root built in $((SECONDS - t0))s"
fi

work=$(mktemp -d /var/tmp/anvil-fresh.XXXXXX)
root=$work/root
remove_work() {
  if ((keep)); then echo "fresh_debian_check: root kept in $root (chroot $root /bin/bash)"; return; fi
  # The mounts were private to the inner namespace, which has ended; refuse to
  # delete if anything under the root is still mounted here all the same.
  if findmnt -rn -o TARGET | grep -q "^$root/"; then
    echo "fresh_debian_check: something is still mounted under $root; left in place" >&2
    return
  fi
  rm -rf --one-file-system "$work"
}
trap remove_work EXIT
mkdir "$root"
tar -C "$root" --numeric-owner -xpf "$cache"
chmod 755 "$root"  # / as on any Debian system (a cache made by an earlier version held 0700)

# This machine's access to the network, not an install step of Anvil: its
# resolver and host names, its APT sources and APT settings (e.g. a snapshot mirror, which
# needs Valid-Until checks off), pip's index and proxy settings, and the
# certificate authorities of the TLS-intercepting proxy through which this
# network reaches the registries.
# A user on an ordinary network needs none of this.
cp -L /etc/resolv.conf "$root/etc/resolv.conf"
# debootstrap writes no /etc/hosts (an installed system has one): without it
# "localhost" goes to DNS, and OpenMPI's look-up of it waited out the 5 s
# resolver timeout in every mpirun (seen as 5 s more per distributed test).
cp -L /etc/hosts "$root/etc/hosts"
if [ -f /etc/apt/sources.list.d/debian.sources ]; then
  rm -f "$root/etc/apt/sources.list"
  cp /etc/apt/sources.list.d/debian.sources "$root/etc/apt/sources.list.d/"
fi
for f in /etc/apt/apt.conf.d/*; do
  # Only the host's own Acquire settings (mirror and proxy access), not
  # files a package installed.
  if grep -q '^[[:space:]]*Acquire' "$f" 2>/dev/null && ! dpkg -S "$f" >/dev/null 2>&1; then
    cp "$f" "$root/etc/apt/apt.conf.d/"
  fi
done
# Extra CAs go where Debian keeps local ones: ca-certificates' postinst
# (scripts/setup.sh installs it) adds them to the system store, which pip
# reads through /etc/pip.conf or PIP_CERT below.
mkdir -p "$root/usr/local/share/ca-certificates"
for crt in /usr/local/share/ca-certificates/*.crt; do
  [ -f "$crt" ] || continue
  cp "$crt" "$root/usr/local/share/ca-certificates/"
done
# pip's settings for this network: its site-wide configuration file, where
# the host has one that no package installed, and the environment variables
# that say where the index is and how to reach it (the inner part passes them).
for f in /etc/pip.conf /etc/xdg/pip/pip.conf; do
  if [ -f "$f" ] && ! dpkg -S "$f" >/dev/null 2>&1; then
    mkdir -p "$root$(dirname "$f")"
    cp "$f" "$root$f"
  fi
done
pass_env=
for v in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST PIP_CERT PIP_CLIENT_CERT PIP_PROXY PIP_DEFAULT_TIMEOUT \
         PIP_RETRIES http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
  if [ -n "${!v:-}" ]; then pass_env+=" $v"; fi
done
export PASS_ENV=$pass_env

# What is committed, not the working tree.
git clone -q --no-hardlinks "$repo" "$root/root/anvil"
echo "fresh_debian_check: $(git -C "$root/root/anvil" log -1 --format='%h %s' | cut -c1-100)"

export MAIN_CMD= TEST_CMD=
# The machine's oracles' environment, where it has one (the tests need it under CI).
ORACLES=$("$repo/scripts/oracles_dir.sh")
if [ -x "$ORACLES/bin/python" ]; then
  echo "fresh_debian_check: the oracles' environment $ORACLES, mounted read-only in the root"
else
  echo "fresh_debian_check: no oracles' environment at $ORACLES (scripts/setup_oracles.sh makes it)"
  ORACLES=
fi
export ORACLES
((run_main)) && MAIN_CMD=$main_cmd
((run_tests)) && TEST_CMD=$test_cmd
status=0
unshare --mount --propagation private -- "$self" --inner "$root" || status=$?
echo "fresh_debian_check: summary (root $work)"
if [ -f "$work/times" ]; then
  while read -r name rc dt; do
    printf '  %-5s exit %d  %dm%02ds\n' "$name" "$rc" $((dt / 60)) $((dt % 60))
  done <"$work/times"
fi
exit $status
