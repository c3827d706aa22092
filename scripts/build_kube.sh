#!/usr/bin/env bash
# Builds kube-apiserver and kube-controller-manager 1.20.2 from Debian's `kubernetes` source package
# (no registry ships these binaries) and caches them OUTSIDE the repo in
#   ${ITERSERVE_KUBE_CACHE:-$HOME/.cache/iterserve/kube-1.20.2}/bin/
# Does nothing when both cached binaries run. A clean build takes 10-20 min on 2 cores, ~1.5 GB RAM,
# ~2.5 GB disk (freed afterwards). Needs root only to add the deb-src entry when it is missing.
set -euo pipefail
cache=${ITERSERVE_KUBE_CACHE:-$HOME/.cache/iterserve/kube-1.20.2}
binaries=(kube-apiserver kube-controller-manager)

cached_binaries_run() {
  local binary
  for binary in "${binaries[@]}"; do
    "$cache/bin/$binary" --version >/dev/null 2>&1 || return 1
  done
}
if cached_binaries_run; then
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

# The upstream Makefile generates the openapi file before compiling; plain `go build` does not.
GOPROXY=off GOFLAGS= CGO_ENABLED=0 KUBE_BUILD_PLATFORMS=linux/amd64 \
  make WHAT="cmd/kube-apiserver cmd/kube-controller-manager"

# Copy next to the target then rename: an interrupted build never leaves a half-written binary in bin/.
for binary in "${binaries[@]}"; do
  cp "_output/local/bin/linux/amd64/$binary" "$cache/bin/.$binary.partial"
  mv -f "$cache/bin/.$binary.partial" "$cache/bin/$binary"
done
cached_binaries_run
echo "build_kube.sh: built ${binaries[*]} into $cache/bin"
