#!/usr/bin/env bash
# Two hosts on one machine, for the multi-host tests: network namespaces
# <name>a and <name>b, joined by a veth link (10.77.0.1 and 10.77.0.2), each
# process in them seeing its namespace's name as its host name. Open MPI
# starts ranks on host b through this script's `agent`, as it would through
# ssh. Needs root and Debian's iproute2 (ip, tc) and util-linux (unshare).
#
#   netns_cluster.sh up NAME            make the two hosts (an old pair of that name is removed first)
#   netns_cluster.sh up-emulated NAME EMULATOR RATE_BITS_PER_S DELAY_US
#                                       the same, joined instead through TAP devices by the user-space
#                                       link EMULATOR (tests/link_emulator.cpp): a slow link on kernels
#                                       whose tc lacks netem
#   netns_cluster.sh link-stats NAME    what the emulator did to each direction's traffic (frames, bytes,
#                                       drops, how long it held frames, the wire time it charged)
#   netns_cluster.sh down NAME          remove them, ending every process still in them (and the emulator)
#   netns_cluster.sh run NAME CMD...    run CMD on host a (mpirun goes here)
#   netns_cluster.sh agent NAME HOST CMD...
#                                       Open MPI's rsh agent: run CMD (one shell string) on HOST
#   netns_cluster.sh cut NAME           take the link down (both ends)
#   netns_cluster.sh heal NAME          bring it back up
#   netns_cluster.sh pids NAME          the pids of every process on either host, one per line
set -euo pipefail

cmd=${1:?usage: netns_cluster.sh up|up-emulated|down|run|agent|cut|heal|link-stats|pids NAME ...}
name=${2:?netns_cluster.sh: a cluster name is needed}
shift 2
a=${name}a b=${name}b
emulator_pid=${TMPDIR:-/tmp}/anvil-netns-$name.emulator.pid
emulator_stats=${TMPDIR:-/tmp}/anvil-netns-$name.link-stats

# Addresses on each host's end of the link, and every interface up.
configure_ends() {
  ip -n "$a" addr add 10.77.0.1/24 dev "${a}v"
  ip -n "$b" addr add 10.77.0.2/24 dev "${b}v"
  for ns in "$a" "$b"; do
    ip -n "$ns" link set lo up
    ip -n "$ns" link set "${ns}v" up
  done
}

case $cmd in
  up)
    ip netns del "$a" 2>/dev/null || true
    ip netns del "$b" 2>/dev/null || true
    ip netns add "$a"
    ip netns add "$b"
    ip link add "${a}v" netns "$a" type veth peer name "${b}v" netns "$b"
    configure_ends
    ;;
  up-emulated)
    emulator=${1:?netns_cluster.sh up-emulated: give the link emulator (its path)}
    rate=${2:?netns_cluster.sh up-emulated: a rate in bits/s is needed}
    delay=${3:?netns_cluster.sh up-emulated: a delay in µs is needed}
    "$0" down "$name"
    ip netns add "$a"
    ip netns add "$b"
    ip tuntap add mode tap name "${a}v"
    ip tuntap add mode tap name "${b}v"
    ready=${TMPDIR:-/tmp}/anvil-netns-$name.ready
    rm -f "$ready"
    setsid "$emulator" "${a}v" "${b}v" "$rate" "$delay" "$ready" "$emulator_stats" </dev/null >/dev/null 2>&1 &
    echo $! >"$emulator_pid"
    for _ in $(seq 100); do [ -e "$ready" ] && break; sleep 0.05; done
    [ -e "$ready" ] || { echo "netns_cluster: the link emulator did not start" >&2; exit 1; }
    rm -f "$ready"
    ip link set "${a}v" netns "$a"
    ip link set "${b}v" netns "$b"
    configure_ends
    ;;
  down)
    for ns in "$a" "$b"; do
      pids=$(ip netns pids "$ns" 2>/dev/null || true)
      [ -n "$pids" ] && kill -KILL $pids 2>/dev/null || true
      ip netns del "$ns" 2>/dev/null || true
      ip link del "${ns}v" 2>/dev/null || true  # a TAP device not yet moved into its host
    done
    if [ -e "$emulator_pid" ]; then
      kill -KILL "$(cat "$emulator_pid")" 2>/dev/null || true
      rm -f "$emulator_pid"
    fi
    rm -f "$emulator_stats" "$emulator_stats.tmp"
    ;;
  run)
    exec ip netns exec "$a" unshare --uts sh -c 'hostname "$0"; exec "$@"' "$a" "$@"
    ;;
  agent)
    host=${1:?netns_cluster.sh agent: a host is needed}
    shift
    case $host in
      10.77.0.1 | "$a") ns=$a ;;
      10.77.0.2 | "$b") ns=$b ;;
      *) echo "netns_cluster: no host $host in cluster $name" >&2; exit 1 ;;
    esac
    # Open MPI gives the command as words for a remote login shell to join.
    exec ip netns exec "$ns" unshare --uts sh -c "hostname $ns; $*"
    ;;
  cut | heal)
    state=$([ "$cmd" = cut ] && echo down || echo up)
    ip -n "$a" link set "${a}v" "$state"
    ip -n "$b" link set "${b}v" "$state"
    ;;
  link-stats)
    [ -e "$emulator_stats" ] || { echo "netns_cluster: $name has no emulated link" >&2; exit 1; }
    cat "$emulator_stats"
    ;;
  pids)
    { ip netns pids "$a" 2>/dev/null; ip netns pids "$b" 2>/dev/null; } || true
    ;;
  *)
    echo "netns_cluster: unknown command '$cmd'" >&2
    exit 2
    ;;
esac
