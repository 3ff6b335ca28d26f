# Sourced by tests/nodes/netns_test.sh and bench/slow_link.sh: network "hosts" (Linux network
# namespaces) joined by veth pairs on a bridge namespace. Needs root and iproute2; returns 1 at
# the first step that fails (errexit does not reach into a function called before ||).
#   netns_hosts BRIDGE NET HOST...   host i (from 1) gets address NET.i on its link vHOST
netns_hosts() {
  local bridge=$1 net=$2 i=1 host
  shift 2
  ip netns add "$bridge" || return 1
  ip -n "$bridge" link add br0 type bridge || return 1
  ip -n "$bridge" link set br0 up || return 1
  for host in "$@"; do
    ip netns add "$host" || return 1
    ip link add "v$host" type veth peer name "p$host" || return 1
    ip link set "v$host" netns "$host" || return 1
    ip link set "p$host" netns "$bridge" || return 1
    ip -n "$bridge" link set "p$host" master br0 up || return 1
    ip -n "$host" addr add "$net.$i/24" dev "v$host" || return 1
    ip -n "$host" link set "v$host" up || return 1
    ip -n "$host" link set lo up || return 1
    i=$((i + 1))
  done
}
