# scripts/local_cluster.sh: certificates, tokens, kubeconfigs and the components' configuration files
# (sourced). Written once; `down --purge` deletes them with the rest of the state.

write_pki() {
  local pki=$state/pki
  [ -s "$pki/apiserver.crt" ] && return 0
  mkdir -p "$pki"
  ( cd "$pki"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3650 \
      -subj /CN=iterserve-local-ca -keyout ca.key -out ca.crt 2>/dev/null
    # the API server's serving certificate: its node address, the `kubernetes` Service's ClusterIP (what
    # pods dial) and loopback
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj /CN=kube-apiserver \
      -keyout apiserver.key -out apiserver.csr 2>/dev/null
    printf 'subjectAltName=IP:%s,IP:%s,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:localhost\n' \
      "$node_ip" "$kubernetes_service_ip" > apiserver.ext
    openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile apiserver.ext -out apiserver.crt 2>/dev/null
    # what the API server shows the kubelet (logs, exec, port-forward): a client certificate in system:masters
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
      -subj "/O=system:masters/CN=kube-apiserver-kubelet-client" -keyout kubelet-client.key \
      -out kubelet-client.csr 2>/dev/null
    printf 'extendedKeyUsage=clientAuth\n' > client.ext
    openssl x509 -req -in kubelet-client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile client.ext -out kubelet-client.crt 2>/dev/null
    # service-account tokens: signed by the controller-manager's token controller and the API server
    openssl ecparam -name prime256v1 -genkey -noout -out sa.key
    openssl ec -in sa.key -pubout -out sa.pub 2>/dev/null
    rm -f ./*.csr ./*.ext
    chmod 600 ./*.key )
}

write_kubeconfig() {  # file user token
  cat > "$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: iterserve-local
  cluster: {server: "https://$node_ip:$apiserver_port", certificate-authority: "$state/pki/ca.crt"}
users:
- name: $2
  user: {token: "$3"}
contexts:
- name: iterserve-local
  context: {cluster: iterserve-local, user: $2, namespace: default}
current-context: iterserve-local
EOF
  chmod 600 "$1"
}

write_tokens() {
  [ -s "$state/etc/tokens.csv" ] && return 0
  mkdir -p "$state/etc"
  local admin kubelet proxy scheduler cm
  admin=$(openssl rand -hex 16); kubelet=$(openssl rand -hex 16); proxy=$(openssl rand -hex 16)
  scheduler=$(openssl rand -hex 16); cm=$(openssl rand -hex 16)
  # Built-in RBAC roles bind system:node:*, system:kube-proxy and system:kube-scheduler; the
  # controller-manager runs every controller with its own credentials, hence system:masters.
  cat > "$state/etc/tokens.csv" <<EOF
$admin,admin,admin,"system:masters"
$kubelet,system:node:$node_name,kubelet,"system:nodes"
$proxy,system:kube-proxy,kube-proxy
$scheduler,system:kube-scheduler,kube-scheduler
$cm,system:kube-controller-manager,kube-controller-manager,"system:masters"
EOF
  chmod 600 "$state/etc/tokens.csv"
  write_kubeconfig "$kubeconfig" admin "$admin"
  write_kubeconfig "$state/etc/kubelet.kubeconfig" "system:node:$node_name" "$kubelet"
  write_kubeconfig "$state/etc/kube-proxy.kubeconfig" system:kube-proxy "$proxy"
  write_kubeconfig "$state/etc/kube-scheduler.kubeconfig" system:kube-scheduler "$scheduler"
  write_kubeconfig "$state/etc/kube-controller-manager.kubeconfig" system:kube-controller-manager "$cm"
}

write_containerd_config() {
  mkdir -p "$state/etc" "$state/cni"
  cat > "$state/etc/containerd.toml" <<EOF
# a private containerd for the local cluster: its own root, state, socket, CNI configuration
version = 2
root = "$state/containerd"
state = "$run_dir"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/iterserve/pause:3.4.1"
  # root here lacks CAP_SYS_RESOURCE: without this runc fails "can't get final child's PID from pipe"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$state/cni"
  # Images come only from \`ctr images import\`: a pull of anything not imported goes to a closed
  # local port and fails at once, never to a registry.
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."docker.io"]
    endpoint = ["http://127.0.0.1:9"]
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."ghcr.io"]
    endpoint = ["http://127.0.0.1:9"]
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."k8s.gcr.io"]
    endpoint = ["http://127.0.0.1:9"]
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."registry.k8s.io"]
    endpoint = ["http://127.0.0.1:9"]
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."*"]
    endpoint = ["http://127.0.0.1:9"]
EOF
  # The pod network: a bridge with the pods' gateway, addresses from host-local, routes to the pod,
  # node and Service ranges only, no masquerading.
  cat > "$state/cni/10-iterserve.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "iterserve",
  "plugins": [{
    "type": "bridge", "bridge": "$pod_bridge", "isGateway": true, "ipMasq": false, "hairpinMode": true,
    "ipam": {
      "type": "host-local", "dataDir": "$state/cni-ipam",
      "ranges": [[{"subnet": "$pod_cidr", "gateway": "$pod_gateway"}]],
      "routes": [{"dst": "$pod_cidr"}, {"dst": "$node_ip/32"}, {"dst": "$service_cidr"}]
    }
  }]
}
EOF
}

write_kubelet_config() {
  mkdir -p "$state/etc" "$state/kubelet"
  # Pods get a resolver on their own loopback: a name lookup fails at once instead of leaving the machine.
  printf 'nameserver 127.0.0.1\noptions timeout:1 attempts:1\n' > "$state/etc/resolv.conf"
  cat > "$state/etc/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $node_ip
port: 10250
readOnlyPort: 0
healthzPort: 0
cgroupDriver: cgroupfs
failSwapOn: false
resolvConf: $state/etc/resolv.conf
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $state/pki/ca.crt}
authorization: {mode: Webhook}
# a developer's disk is fuller than a server's: evict only when nearly nothing is left; never drop images
evictionHard: {memory.available: 200Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
# no kubelet iptables chains beyond its canaries: kube-proxy owns the rules
makeIPTablesUtilChains: false
nodeStatusUpdateFrequency: 5s
serializeImagePulls: false
containerLogMaxSize: 10Mi
EOF
}
