# Shared names, paths and helpers of scripts/local_cluster.sh (sourced, not run).
# Everything the cluster makes is named here, so that `down` can find and undo it.

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
state=${ITERSERVE_CLUSTER_DIR:-$HOME/.cache/iterserve/local-cluster}
kube_bin=${ITERSERVE_KUBE_CACHE:-$HOME/.cache/iterserve/kube-1.20.2}/bin
image_cache=${ITERSERVE_IMAGE_CACHE:-$HOME/.cache/iterserve/images}
run_dir=/run/iterserve-containerd            # containerd's state and socket (a private instance)
sock=$run_dir/containerd.sock
kubeconfig=$state/kubeconfig                 # the admin's (system:masters)
node_name=iterserve-node
# Addresses: the node's on a port-less bridge of its own (loopback node IPs are refused, and this kernel
# has no dummy driver), the pods' on the CNI bridge, the Services' virtual range. Pods get routes to
# these three ranges only: no default route, so nothing in a pod can reach past this machine.
node_bridge=itsnode0
node_ip=10.89.0.1
pod_bridge=itscni0
pod_cidr=10.88.0.0/16
pod_gateway=10.88.0.1
service_cidr=10.97.0.0/16
kubernetes_service_ip=10.97.0.1
apiserver_port=6443
etcd_port=${ITERSERVE_CLUSTER_ETCD_PORT:-23790}
# the rules that keep forwarded traffic off the machine's uplinks carry this comment
rule_comment=iterserve-local-cluster
# sysctls the components change (bridge plugin: ip_forward; kube-proxy: route_localnet; kubelet: the
# kernel tunables it insists on), saved before `up` and restored by `down`
saved_sysctls=(net.ipv4.ip_forward net.ipv4.conf.all.route_localnet net.bridge.bridge-nf-call-iptables
  vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops
  kernel.keys.root_maxkeys kernel.keys.root_maxbytes)
components=(etcd kube-apiserver kube-controller-manager kube-scheduler containerd kubelet kube-proxy)

say() { echo "local_cluster.sh: $*" >&2; }
die() { say "error: $*"; exit 1; }

kubectl_bin() {
  if [ -x "$root/.venv/bin/kubectl" ]; then echo "$root/.venv/bin/kubectl"; else command -v kubectl; fi
}
kc() { "$(kubectl_bin)" --kubeconfig "$kubeconfig" "$@"; }
ctr_() { ctr --address "$sock" --namespace k8s.io "$@"; }

pid_of() {  # the live pid of a component this script started, else nothing
  local file=$state/run/$1.pid pid
  [ -s "$file" ] || return 1
  pid=$(cat "$file")
  # the pid must still be that component (a recycled pid is someone else's process)
  # (no `| grep -q` under pipefail: grep's early exit makes the pipeline fail)
  if kill -0 "$pid" 2>/dev/null && [[ $(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null) == *"$1"* ]]; then
    echo "$pid"
  else
    return 1
  fi
}

start_daemon() {  # name env... -- argv...: runs in its own session, logs to logs/NAME.log
  local name=$1; shift
  local env=()
  while [ "$1" != -- ]; do env+=("$1"); shift; done
  shift
  if pid_of "$name" >/dev/null; then
    return 0
  fi
  mkdir -p "$state/run" "$state/logs"
  env "${env[@]}" setsid "$@" >>"$state/logs/$name.log" 2>&1 < /dev/null &
  echo $! > "$state/run/$name.pid"
}

stop_daemon() {  # name [seconds]: SIGTERM, then SIGKILL
  local name=$1 wait=${2:-15} pid i
  pid=$(pid_of "$name") || { rm -f "$state/run/$name.pid"; return 0; }
  kill "$pid" 2>/dev/null || true
  for ((i = 0; i < wait * 10; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$state/run/$name.pid"
}

wait_for() {  # seconds what command...: polls until the command succeeds
  local seconds=$1 what=$2 i
  shift 2
  for ((i = 0; i < seconds * 2; i++)); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  die "$what did not come up within ${seconds}s; see $state/logs/"
}
