# scripts/local_cluster.sh: the node's address, the guard rules and the sysctls, and their undoing (sourced).
# Every change is recorded in $state/undo/ before it is made, so `down` undoes a half-made `up` too.

uplinks() {  # the interfaces that lead off this machine (those holding a default route)
  ip -o route show default 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p' | sort -u
  ip -o -6 route show default 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p' | sort -u
}

save_sysctls() {
  mkdir -p "$state/undo"
  [ -s "$state/undo/sysctls" ] && return 0  # the values from before the first `up`
  local name
  for name in "${saved_sysctls[@]}"; do
    sysctl -n "$name" >/dev/null 2>&1 && echo "$name=$(sysctl -n "$name")"
  done > "$state/undo/sysctls.partial"
  mv "$state/undo/sysctls.partial" "$state/undo/sysctls"
}

restore_sysctls() {
  [ -s "$state/undo/sysctls" ] || return 0
  local line
  while IFS= read -r line; do
    sysctl -q -w "$line" >/dev/null || say "could not restore sysctl $line"
  done < "$state/undo/sysctls"
  rm -f "$state/undo/sysctls"
}

guard_rules() {  # add|delete: drop anything forwarded to or from an uplink (the bridge plugin turns
                 # ip_forward on; without these a pod's packets could be routed off the machine)
  local action=$1 link family
  for family in iptables ip6tables; do
    command -v "$family" >/dev/null || continue
    for link in $(uplinks); do
      for dir in -i -o; do
        local rule=(FORWARD "$dir" "$link" -m comment --comment "$rule_comment" -j DROP)
        if [ "$action" = add ]; then
          "$family" -w -t mangle -C "${rule[@]}" 2>/dev/null || "$family" -w -t mangle -I "${rule[@]}"
        fi
      done
    done
    if [ "$action" = delete ]; then  # by comment: also the rules of an uplink that has changed since
      "$family" -w -t mangle -S FORWARD 2>/dev/null | grep -- "--comment $rule_comment" | sed 's/^-A //' |
        while read -r -a spec; do "$family" -w -t mangle -D "${spec[@]}" || true; done || true  # none: grep fails
    fi
  done
}

make_node_address() {
  if ! ip link show "$node_bridge" >/dev/null 2>&1; then
    echo "$node_bridge" >> "$state/undo/links"
    ip link add "$node_bridge" type bridge
  fi
  [[ $(ip -o -4 addr show dev "$node_bridge") == *"inet $node_ip/32"* ]] || ip addr add "$node_ip/32" dev "$node_bridge"
  ip link set "$node_bridge" up
}

remove_kube_chains() {  # what kube-proxy --cleanup leaves: the kubelet's canaries and any KUBE- chain
  local family table chain
  for family in iptables ip6tables; do
    command -v "$family" >/dev/null || continue
    for table in filter nat mangle; do
      # rules that jump to a KUBE- chain from a built-in chain, then the chains themselves
      "$family" -w -t "$table" -S 2>/dev/null | grep -E '^-A [A-Z]+ .*-j KUBE-' | grep -vE '^-A KUBE-' |
        sed 's/^-A //' | while read -r -a spec; do "$family" -w -t "$table" -D "${spec[@]}" 2>/dev/null || true; done ||
        true  # none: grep fails
      for chain in $("$family" -w -t "$table" -S 2>/dev/null | sed -n 's/^-N \(KUBE-[^ ]*\)$/\1/p'); do
        "$family" -w -t "$table" -F "$chain" 2>/dev/null || true
      done
      for chain in $("$family" -w -t "$table" -S 2>/dev/null | sed -n 's/^-N \(KUBE-[^ ]*\)$/\1/p'); do
        "$family" -w -t "$table" -X "$chain" 2>/dev/null || true
      done
    done
  done
}

remove_links() {
  local link
  for link in "$pod_bridge" $(cat "$state/undo/links" 2>/dev/null); do
    ip link show "$link" >/dev/null 2>&1 && ip link delete "$link"
  done
  rm -f "$state/undo/links"
}

remove_netns() {  # the pods' network namespaces containerd made (cni-*), not those there before `up`
  local ns
  for ns in $(ls /var/run/netns 2>/dev/null | grep '^cni-'); do
    grep -qx "$ns" "$state/undo/netns-before" 2>/dev/null && continue
    umount "/var/run/netns/$ns" 2>/dev/null || umount -l "/var/run/netns/$ns" 2>/dev/null || true
    rm -f "/var/run/netns/$ns"
  done
}

# Connections of this cluster's processes and pods that leave the addresses it made (loopback, the
# node address, the pod and Service ranges), and any flow to link-local 169.254/16 (cloud metadata):
# printed one a line; nothing when all is well.
foreign_traffic() {
  local pids=() name pid
  for name in "${components[@]}"; do
    pid=$(pid_of "$name") && pids+=("$pid")
  done
  local local_re='^(127\.|10\.89\.0\.1$|10\.88\.|10\.97\.|\[?::1\]?$|\[?::ffff:127\.|\*$|0\.0\.0\.0$)'
  if [ ${#pids[@]} -gt 0 ]; then
    ss -Htanup 2>/dev/null | while read -r proto st recvq sendq laddr raddr rest; do
      for pid in "${pids[@]}"; do
        if [[ $rest == *"pid=$pid,"* ]]; then
          addr=${raddr%:*}
          [[ $addr =~ $local_re ]] || echo "$proto $laddr -> $raddr ($rest)"
        fi
      done
    done
  fi
  # every flow the kernel tracked from the pod network or the node address to anywhere else (the first
  # src=/dst= pair of a line is the original direction)
  if command -v conntrack >/dev/null; then
    conntrack -L 2>/dev/null | awk '{
      src = ""; dst = ""
      for (i = 1; i <= NF; i++) {
        if (src == "" && $i ~ /^src=/) src = substr($i, 5)
        else if (dst == "" && $i ~ /^dst=/) dst = substr($i, 5)
      }
      ours = (src ~ /^10\.88\./ || src == "10.89.0.1")
      # 224.0.0.x: link-local multicast (IGMP reports of the bridge), never routed off a link
      local = (dst ~ /^(127\.|10\.88\.|10\.97\.|224\.0\.0\.)/ || dst == "10.89.0.1")
      if ((ours && !local) || dst ~ /^169\.254\./) print "conntrack: " $0  # 169.254/16: cloud metadata
    }'
  fi
}
