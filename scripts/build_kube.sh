#!/usr/bin/env bash
# Builds Kubernetes 1.20.2 binaries from Debian's `kubernetes` source package (no registry ships them) and
# caches them OUTSIDE the repo in
#   ${ITERSERVE_KUBE_CACHE:-$HOME/.cache/iterserve/kube-1.20.2}/bin/
#   bash scripts/build_kube.sh            kube-apiserver, kube-controller-manager (the test suite's)
#   bash scripts/build_kube.sh node       also kubelet, kube-scheduler, kube-proxy and the pause
#                                         container's binary (scripts/local_cluster.sh)
# Builds only the binaries missing from the cache. A clean build of the first two takes 10-20 min on
# 2 cores, ~1.5 GB RAM, ~2.5 GB disk (freed afterwards); the node's three ~5 min more. Needs root only to
# add the deb-src entry when it is missing.
# The kubelet is built WITHOUT the AWS/Azure/GCP image-credential providers: upstream 1.20 links them
# unconditionally and the AWS one calls the cloud metadata address (169.254.169.254) at start.
set -euo pipefail
cache=${ITERSERVE_KUBE_CACHE:-$HOME/.cache/iterserve/kube-1.20.2}
binaries=(kube-apiserver kube-controller-manager)
if [ "${1:-}" = node ]; then
  binaries+=(kubelet kube-scheduler kube-proxy)
fi

runs() {  # cached binary answers --version
  "$cache/bin/$1" --version >/dev/null 2>&1
}
missing=()
for binary in "${binaries[@]}"; do
  runs "$binary" || missing+=("$binary")
done
need_pause=false
if [ "${1:-}" = node ] && [ ! -x "$cache/bin/pause" ]; then
  need_pause=true
fi
if [ ${#missing[@]} -eq 0 ] && ! $need_pause; then
  exit 0
fi

# apt-get source needs a deb-src entry for bookworm main (Debian images ship only binary entries) and
# its package lists downloaded.
known_source=$(apt-cache showsrc --only-source kubernetes 2>/dev/null || true)
if [ -z "$known_source" ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "build_kube.sh: apt knows no source package 'kubernetes'; run as root once, or add a deb-src" \
      "entry for bookworm main and run apt-get update" >&2
    exit 1
  fi
  if ! grep -rqs deb-src /etc/apt/sources.list /etc/apt/sources.list.d/; then
    cat > /etc/apt/sources.list.d/iterserve-deb-src.sources <<'SOURCES'
# Added by iterserve scripts/build_kube.sh to build kube-apiserver from Debian's kubernetes source.
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
  fi
  apt-get update -q
fi

mkdir -p "$cache/bin"
work=$(mktemp -d "$cache/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
apt-get source --download-only kubernetes
dpkg-source -x kubernetes_*.dsc src
cd src

# The vendored reflect2 1.0.1 crashes under Go >= 1.18 ("fatal error: fault"); Debian's 1.0.2 works.
rm -rf vendor/github.com/modern-go/reflect2
cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 vendor/github.com/modern-go/reflect2
rm -f vendor/github.com/modern-go/reflect2/go.mod

# No cloud credential providers in the kubelet (see the header); fail rather than build one with them.
sed -i -E '\#^\s*_ "k8s.io/kubernetes/pkg/credentialprovider/(aws|azure|gcp)"#d' cmd/kubelet/app/plugins.go
if grep -qE 'pkg/credentialprovider/(aws|azure|gcp)"' cmd/kubelet/app/plugins.go; then
  echo "build_kube.sh: could not remove the cloud credential providers from cmd/kubelet/app/plugins.go" >&2
  exit 1
fi

# The pause container's process (the pod sandbox), static: the image is this one file.
if $need_pause; then
  gcc -Os -static -DVERSION=v3.4.1-iterserve -o "$cache/bin/.pause.partial" build/pause/linux/pause.c
  mv -f "$cache/bin/.pause.partial" "$cache/bin/pause"
fi

if [ ${#missing[@]} -gt 0 ]; then
  # The upstream Makefile generates the openapi file before compiling; plain `go build` does not.
  GOPROXY=off GOFLAGS= CGO_ENABLED=0 KUBE_BUILD_PLATFORMS=linux/amd64 \
    make WHAT="${missing[*]/#/cmd/}"
fi

# Copy next to the target then rename: an interrupted build never leaves a half-written binary in bin/.
for binary in "${missing[@]}"; do
  cp "_output/local/bin/linux/amd64/$binary" "$cache/bin/.$binary.partial"
  mv -f "$cache/bin/.$binary.partial" "$cache/bin/$binary"
  runs "$binary"
done
echo "build_kube.sh: built ${missing[*]} $($need_pause && echo pause) into $cache/bin"
