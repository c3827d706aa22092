#!/usr/bin/env bash
# Idempotent: installs the Debian packages the Kubernetes tests need (Go to build kube-apiserver and
# kube-controller-manager from Debian's source package, etcd, Prometheus, and build tools), and g++ and
# ninja, which build the C++ CPU attention kernel (kernels/cpu_paged_attention.py) on first use.
# `cluster` adds what scripts/build_images.sh and scripts/local_cluster.sh need: containerd, runc, the CNI
# plugins, iptables, conntrack, buildah and mmdebstrap.
# Does nothing when every package is already installed; otherwise needs root (apt-get install).
set -euo pipefail
packages=(golang-go etcd-server prometheus make rsync jq openssl golang-github-modern-go-reflect2-dev dpkg-dev g++ ninja-build)
if [ "${1:-}" = cluster ]; then
  packages+=(containerd runc containernetworking-plugins iptables conntrack buildah mmdebstrap)
fi
missing=()
for package in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null || true)
  [ "$status" = "install ok installed" ] || missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "install_system_deps.sh: missing Debian packages: ${missing[*]}" >&2
  echo "run as root, or: sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
