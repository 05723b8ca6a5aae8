#!/usr/bin/env bash
# Build deep_ep (DeepEP's V1 `deep_ep.Buffer` API, the one all2all/deepep.py drives) on a Hopper
# (H100 / H200) host with no network, from files carried there. docs/deepep.md explains each step.
#
#   tools/build_deep_ep.sh fetch DIR [--cuda 12|13] [--nvshmem-version V] [--python 3.12]
#       On a machine with package-registry access: put the NVSHMEM wheel and the registry's deep-ep
#       source package into DIR, and say what else to bring.
#   tools/build_deep_ep.sh build --src SRC [--nvshmem-wheel WHL] [--out DIR] [--install] [--arch 9.0]
#       On the GPU host: check SRC (a DeepEP source directory, .tar.gz or .zip), make NVSHMEM
#       available from the wheel, build a deep_ep wheel into DIR (default ./dist-deep_ep) and,
#       with --install, install it and import it.
set -euo pipefail

PY=${PYTHON:-python3}
die() { echo "build_deep_ep: $*" >&2; exit 1; }

usage() { sed -n '2,11p' "$0"; exit "${1:-0}"; }

cmd_fetch() {
  local dir="" cuda=13 nvshmem="" pyver=3.12
  while [ $# -gt 0 ]; do
    case "$1" in
      --cuda) cuda=$2; shift 2 ;;
      --nvshmem-version) nvshmem=$2; shift 2 ;;
      --python) pyver=$2; shift 2 ;;
      -h|--help) usage ;;
      *) [ -z "$dir" ] || die "unexpected argument $1"; dir=$1; shift ;;
    esac
  done
  [ -n "$dir" ] || die "fetch needs a DIR"
  case "$cuda" in 12|13) ;; *) die "--cuda ($cuda) must be one of [12, 13]" ;; esac
  # torch 2.11 (cu130) ships against NVSHMEM 3.4.5; a DeepEP V1 tree of July 2025 or later builds with 3.3.9+.
  [ -n "$nvshmem" ] || nvshmem=3.4.5
  mkdir -p "$dir"
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$dir" "nvidia-nvshmem-cu${cuda}==${nvshmem}"
  # The registry's deep-ep source package. `pip download` cannot fetch it on most machines: preparing
  # its metadata runs a setup.py that needs CUDA and NVSHMEM_DIR. pip's own finder fetches the file.
  "$PY" - "$dir" <<'EOF' || echo "build_deep_ep: could not fetch the deep-ep source package (not needed for the build)" >&2
import sys
from pip._internal.index.collector import LinkCollector
from pip._internal.index.package_finder import PackageFinder
from pip._internal.models.search_scope import SearchScope
from pip._internal.models.selection_prefs import SelectionPreferences
from pip._internal.network.session import PipSession
from pip._internal.configuration import Configuration

cfg = Configuration(isolated=False)
cfg.load()
index = dict(cfg.items()).get("global.index-url", "https://pypi.org/simple")
session = PipSession()
finder = PackageFinder.create(
    link_collector=LinkCollector(session=session, search_scope=SearchScope.create([], [index], False)),
    selection_prefs=SelectionPreferences(allow_yanked=False))
for cand in finder.find_all_candidates("deep-ep"):
    if cand.link.filename.endswith(".tar.gz"):
        data = session.get(cand.link.url_without_fragment)
        data.raise_for_status()
        with open(f"{sys.argv[1]}/{cand.link.filename}", "wb") as f:
            f.write(data.content)
        print(f"saved {cand.link.filename} ({len(data.content)} bytes)")
EOF
  cat <<EOF
build_deep_ep: in $dir now:
$(ls -1 "$dir")
Also bring a DeepEP V1 source tree (see docs/deepep.md, "What to download"): the registry's
deep_ep-1.0.0.tar.gz lacks its headers and needs a patched NVSHMEM, so it cannot be built.
EOF
}

unpack_src() {  # $1: dir / .tar.gz / .tgz / .zip ; prints the source root
  local src=$1 work=$2
  if [ -d "$src" ]; then (cd "$src" && pwd); return; fi
  [ -f "$src" ] || die "--src ($src) is neither a directory nor a file"
  mkdir -p "$work/src"
  case "$src" in
    *.tar.gz|*.tgz) tar -xzf "$src" -C "$work/src" ;;
    *.zip) "$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$src" "$work/src" ;;
    *) die "--src ($src) must be a directory, .tar.gz, .tgz or .zip" ;;
  esac
  local setup
  setup=$(find "$work/src" -maxdepth 3 -name setup.py | head -1)
  [ -n "$setup" ] || die "no setup.py inside $src"
  dirname "$setup"
}

check_src() {  # $1: source root
  local root=$1 missing=""
  if [ ! -e "$root/deep_ep/buffer.py" ] || ! grep -q "def low_latency_dispatch" "$root/deep_ep/buffer.py"; then
    die "the source at $root has no V1 deep_ep.Buffer (deep_ep/buffer.py with low_latency_dispatch); DeepEP V2
trees keep V1 elsewhere: use DeepEP's V1 (legacy) tree (docs/deepep.md, \"What to download\")."
  fi
  for f in csrc/deep_ep.cpp csrc/deep_ep.hpp csrc/config.hpp csrc/kernels/api.cuh csrc/kernels/configs.cuh \
           csrc/kernels/launch.cuh csrc/kernels/utils.cuh; do
    [ -e "$root/$f" ] || missing="$missing $f"
  done
  if [ -n "$missing" ]; then
    die "the source at $root is incomplete (missing:$missing). The registry's deep_ep-1.0.0.tar.gz ships no
headers and cannot be built by anyone; bring a DeepEP V1 source tree (docs/deepep.md, \"What to download\")."
  fi
  if ! grep -q "libnvshmem_host\|nvidia.nvshmem" "$root/setup.py"; then
    die "the source at $root links the DeepEP-patched NVSHMEM (libnvshmem.a), which the NVSHMEM wheel does not
provide; use a DeepEP V1 tree from July 2025 or later (its setup.py finds the nvidia-nvshmem wheel)."
  fi
}

cmd_build() {
  local src="" wheel="" out="dist-deep_ep" install=0 arch="9.0"
  while [ $# -gt 0 ]; do
    case "$1" in
      --src) src=$2; shift 2 ;;
      --nvshmem-wheel) wheel=$2; shift 2 ;;
      --out) out=$2; shift 2 ;;
      --install) install=1; shift ;;
      --arch) arch=$2; shift 2 ;;
      -h|--help) usage ;;
      *) die "unexpected argument $1" ;;
    esac
  done
  [ -n "$src" ] || die "build needs --src (a DeepEP V1 source directory or archive)"
  local work
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  local root
  root=$(unpack_src "$src" "$work")
  check_src "$root"
  command -v nvcc >/dev/null || die "nvcc is not on PATH (install the CUDA toolkit, or add its bin/ to PATH)"
  "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" \
    || die "$PY's torch is not a CUDA build"

  # NVSHMEM from the wheel, installed into this Python so DeepEP's setup.py finds `nvidia.nvshmem`
  # (and the built extension's rpath points at it). NVSHMEM_DIR stays unset for that lookup.
  if [ -n "$wheel" ]; then
    [ -f "$wheel" ] || die "--nvshmem-wheel ($wheel) does not exist"
    "$PY" -m pip install -q --no-index --no-deps "$wheel"
  fi
  "$PY" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('nvidia.nvshmem') else 1)" \
    || die "NVSHMEM is not installed in $PY; pass --nvshmem-wheel nvidia_nvshmem_cu*.whl"
  unset NVSHMEM_DIR
  local cuda_home
  cuda_home=$(dirname "$(dirname "$(command -v nvcc)")")
  # CUDA 13 moved the CCCL headers (cuda/std/..., cub, thrust) under include/cccl.
  if [ -d "$cuda_home/include/cccl" ]; then
    export CPATH="$cuda_home/include/cccl${CPATH:+:$CPATH}"
  fi
  export CUDA_HOME="$cuda_home" TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
  echo "build_deep_ep: source $root, CUDA $cuda_home, arch $arch, $MAX_JOBS jobs"
  mkdir -p "$out"
  "$PY" -m pip wheel --no-build-isolation --no-deps --no-index -w "$out" "$root"
  local built
  built=$(ls -t "$out"/deep_ep-*.whl | head -1)
  echo "build_deep_ep: built $built"
  if [ "$install" = 1 ]; then
    "$PY" -m pip install -q --no-index --no-deps --force-reinstall "$built"
    (cd / && "$PY" -c "import deep_ep, inspect; print('deep_ep imports:', deep_ep.__file__); \
print('low_latency_dispatch args:', list(inspect.signature(deep_ep.Buffer.low_latency_dispatch).parameters)[1:])")
  fi
}

case "${1:-}" in
  fetch) shift; cmd_fetch "$@" ;;
  build) shift; cmd_build "$@" ;;
  -h|--help|"") usage ;;
  *) die "unknown command ${1} (fetch or build)" ;;
esac
