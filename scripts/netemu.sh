#!/usr/bin/env bash
# Emulated two-level network on one machine (root): two network namespaces ("nodes")
# joined by one veth pair (the "inter-node" link), token-bucket shaped with tc tbf on
# both ends' egress; inside a node ranks talk over the namespace's own loopback path
# (unshaped). Addresses exist only inside the namespaces this script creates:
#   <name>A: veth <name>a = 10.231.0.1/30    <name>B: veth <name>b = 10.231.0.2/30
# No default route, no link to the host's namespace: nothing can reach another network.
#
#   scripts/netemu.sh up NAME [RATE]    # create (RATE e.g. 100mbit, 1gbit, none)
#   scripts/netemu.sh shape NAME RATE   # change the shaping (none: remove it)
#   scripts/netemu.sh down NAME         # remove namespaces and veths (idempotent)
#   scripts/netemu.sh check             # exit 0 if this machine can do it (root, ip, tc)
# NAME: 2-8 letters/digits (interface names must stay under 16 characters).
set -euo pipefail

die() { echo "netemu: $*" >&2; exit 2; }

check() {
    [ "$(id -u)" = 0 ] || die "needs root (network namespaces, tc)"
    command -v ip >/dev/null || die "needs iproute2 (ip)"
    command -v tc >/dev/null || die "needs iproute2 (tc)"
}

name_ok() {
    [[ "${1:-}" =~ ^[a-z0-9]{2,8}$ ]] || die "NAME must be 2-8 lowercase letters/digits, got '${1:-}'"
}

shape() {  # shape NAME RATE
    local n=$1 rate=$2 ns dev
    for side in A:a B:b; do
        ns="$n${side%%:*}"; dev="$n${side##*:}"
        ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
        if [ "$rate" != none ]; then
            # burst >= one 64 KiB GSO segment; 100 ms queue before tbf drops
            ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$rate" \
                burst 256kb latency 100ms
        fi
    done
}

down() {
    local n=$1
    ip netns del "${n}A" 2>/dev/null || true   # deleting a namespace removes its veth end
    ip netns del "${n}B" 2>/dev/null || true
    ip link del "${n}a" 2>/dev/null || true    # if set-up failed before the move
}

up() {
    local n=$1 rate=${2:-none}
    down "$n"
    trap 'down "$n"' ERR
    ip netns add "${n}A"
    ip netns add "${n}B"
    ip link add "${n}a" type veth peer name "${n}b"
    ip link set "${n}a" netns "${n}A"
    ip link set "${n}b" netns "${n}B"
    ip -n "${n}A" addr add 10.231.0.1/30 dev "${n}a"
    ip -n "${n}B" addr add 10.231.0.2/30 dev "${n}b"
    for ns in "${n}A" "${n}B"; do ip -n "$ns" link set lo up; done
    ip -n "${n}A" link set "${n}a" up
    ip -n "${n}B" link set "${n}b" up
    shape "$n" "$rate"
    trap - ERR
}

cmd=${1:-}
case "$cmd" in
    check) check ;;
    up) check; name_ok "${2:-}"; up "$2" "${3:-none}" ;;
    shape) check; name_ok "${2:-}"; [ -n "${3:-}" ] || die "shape needs a RATE"; shape "$2" "$3" ;;
    down) check; name_ok "${2:-}"; down "$2" ;;
    *) die "usage: $0 up NAME [RATE] | shape NAME RATE | down NAME | check" ;;
esac
