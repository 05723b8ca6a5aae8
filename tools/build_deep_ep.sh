#!/usr/bin/env bash
# Build deep_ep (DeepEP's V1 `deep_ep.Buffer` API, the one all2all/deepep.py drives) with no network,
# on a CPU machine with nvcc or on the Hopper host itself. docs/deepep.md explains each step.
#
#   tools/build_deep_ep.sh fetch DIR [--cuda 12|13] [--nvshmem-version V] [--python 3.12]
#       On a machine with registry access: put the NVSHMEM wheel and rdma-core's header package
#       (Debian's libibverbs-dev, for infiniband/mlx5dv.h) into DIR.
#   tools/build_deep_ep.sh build --src SRC [--nvshmem-wheel WHL] [--ibverbs DEB|DIR] [--out DIR]
#                                [--install] [--arch 9.0] [--keep-ibgda-assert]
#       SRC: a DeepEP V1 source directory or archive (../shared/deps/DeepEP-567632d.tar.gz). Builds a
#       deep_ep wheel into DIR (default ./dist-deep_ep); --install installs and imports it.
set -euo pipefail

PY=${PYTHON:-python3}
die() { echo "build_deep_ep: $*" >&2; exit 1; }

usage() { sed -n '2,12p' "$0"; exit "${1:-0}"; }

cmd_fetch() {
  local dir="" cuda=13 nvshmem=3.4.5 pyver=3.12
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
  mkdir -p "$dir"
  # torch 2.11 (cu130) pins NVSHMEM 3.4.5; DeepEP's V1 line is reported incompatible with 3.5+.
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$dir" "nvidia-nvshmem-cu${cuda}==${nvshmem}"
  (cd "$dir" && apt-get download libibverbs-dev) \
    || echo "build_deep_ep: apt-get could not download libibverbs-dev; bring its .deb (headers only) by hand" >&2
  echo "build_deep_ep: in $dir now:"; ls -1 "$dir"
}

unpack_src() {  # $1: dir / .tar.gz / .tgz / .zip, $2: scratch dir; prints a writable source root
  local src=$1 work=$2
  mkdir -p "$work/src"
  if [ -d "$src" ]; then
    cp -r "$src" "$work/src/"
  else
    [ -f "$src" ] || die "--src ($src) is neither a directory nor a file"
    case "$src" in
      *.tar.gz|*.tgz) tar -xzf "$src" -C "$work/src" ;;
      *.zip) "$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$src" "$work/src" ;;
      *) die "--src ($src) must be a directory, .tar.gz, .tgz or .zip" ;;
    esac
  fi
  local setup
  setup=$(find "$work/src" -maxdepth 3 -name setup.py | head -1)
  [ -n "$setup" ] || die "no setup.py inside $src"
  dirname "$setup"
}

check_src() {  # $1: source root
  local root=$1 missing=""
  if [ ! -e "$root/deep_ep/buffer.py" ] || ! grep -q "def low_latency_dispatch" "$root/deep_ep/buffer.py"; then
    die "the source at $root has no V1 deep_ep.Buffer (deep_ep/buffer.py with low_latency_dispatch); use the
DeepEP V1 archive in ../shared/deps (docs/deepep.md)."
  fi
  for f in csrc/deep_ep.cpp csrc/deep_ep.hpp csrc/config.hpp csrc/kernels/api.cuh csrc/kernels/configs.cuh \
           csrc/kernels/launch.cuh csrc/kernels/utils.cuh csrc/kernels/internode_ll.cu; do
    [ -e "$root/$f" ] || missing="$missing $f"
  done
  [ -z "$missing" ] || die "the source at $root is incomplete (missing:$missing); the registry's deep_ep-1.0.0 sdist
ships no headers. Use the DeepEP V1 archive in ../shared/deps (docs/deepep.md)."
  grep -q "nvidia.nvshmem" "$root/setup.py" \
    || die "the source at $root links DeepEP's patched NVSHMEM (libnvshmem.a), not the nvidia-nvshmem wheel"
}

# The low-latency dispatch asserts that IBGDA opened at least one RC queue pair per local expert. On a host
# without an mlx5 NIC (NVLink-only nodes, one GPU) IBGDA never initialises, the count is 0 and the kernel
# traps although every send goes over NVLink or is a local copy. The patch keeps the check where IBGDA is
# initialised and skips it elsewhere.
IBGDA_ASSERT='EP_DEVICE_ASSERT(ibgda_get_state()->num_rc_per_pe >= num_local_experts);'
IBGDA_ASSERT_NO_NIC='EP_DEVICE_ASSERT(not nvshmemi_device_state_d.ibgda_is_initialized or ibgda_get_state()->num_rc_per_pe >= num_local_experts);'

patch_no_nic() {  # $1: source root
  local f="$1/csrc/kernels/internode_ll.cu"
  "$PY" - "$f" "$IBGDA_ASSERT" "$IBGDA_ASSERT_NO_NIC" <<'EOF' || die "could not apply the no-NIC patch to $f"
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
n = text.count(old)
if n != 1:
    sys.exit(f"build_deep_ep: expected the IBGDA queue-pair assert once in {path}, found it {n} times")
open(path, "w").write(text.replace(old, new))
print(f"build_deep_ep: no-NIC patch applied to {path}")
EOF
}

ibverbs_include() {  # $1: a libibverbs-dev .deb or a directory holding infiniband/mlx5dv.h; $2 scratch; prints the dir
  local src=$1 work=$2
  if [ -d "$src" ]; then
    [ -e "$src/infiniband/mlx5dv.h" ] || die "--ibverbs ($src) has no infiniband/mlx5dv.h"
    (cd "$src" && pwd); return
  fi
  [ -f "$src" ] || die "--ibverbs ($src) is neither a .deb nor a directory"
  mkdir -p "$work/ibverbs"
  (cd "$work/ibverbs" && ar x "$(realpath "$src")" && tar -xf data.tar.*) \
    || die "could not unpack --ibverbs ($src) (needs ar and tar)"
  [ -e "$work/ibverbs/usr/include/infiniband/mlx5dv.h" ] || die "--ibverbs ($src) holds no infiniband/mlx5dv.h"
  echo "$work/ibverbs/usr/include"
}

pip_cuda_include() {  # the include dir of the CUDA library wheels in $PY holding cusparse.h
  "$PY" - <<'EOF'
import importlib.util, os, sys
spec = importlib.util.find_spec("nvidia")
for base in (spec.submodule_search_locations if spec else []):
    for sub in ("cu13", "cu12", "cusparse"):
        d = os.path.join(base, sub, "include")
        if os.path.exists(os.path.join(d, "cusparse.h")):
            print(d)
            sys.exit(0)
sys.exit(1)
EOF
}

cuda_home() {  # the toolkit nvcc belongs to (nvcc may be a wrapper script outside it)
  if [ -n "${CUDA_HOME:-}" ]; then echo "$CUDA_HOME"; return; fi
  local top
  top=$(cd /tmp && nvcc --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
  [ -n "$top" ] || top=$(dirname "$(command -v nvcc)")/..
  (cd "$top" 2>/dev/null && pwd) || die "cannot tell where nvcc's toolkit is; set CUDA_HOME"
}

cmd_build() {
  local src="" wheel="" ibverbs="" out="dist-deep_ep" install=0 arch="9.0" patch=1
  while [ $# -gt 0 ]; do
    case "$1" in
      --src) src=$2; shift 2 ;;
      --nvshmem-wheel) wheel=$2; shift 2 ;;
      --ibverbs) ibverbs=$2; shift 2 ;;
      --out) out=$2; shift 2 ;;
      --install) install=1; shift ;;
      --arch) arch=$2; shift 2 ;;
      --keep-ibgda-assert) patch=0; shift ;;
      -h|--help) usage ;;
      *) die "unexpected argument $1" ;;
    esac
  done
  [ -n "$src" ] || die "build needs --src (a DeepEP V1 source directory or archive)"
  local t0=$SECONDS root cuda inc extra
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  local work=$WORK
  root=$(unpack_src "$src" "$work")
  check_src "$root"
  [ "$patch" = 0 ] || patch_no_nic "$root"
  command -v nvcc >/dev/null || die "nvcc is not on PATH (install the CUDA toolkit, or add its bin/ to PATH)"
  "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" || die "$PY's torch is not a CUDA build"

  # NVSHMEM from the wheel, installed into this Python so DeepEP's setup.py finds `nvidia.nvshmem`
  # (and the extension's rpath points at it). NVSHMEM_DIR stays unset for that lookup.
  if [ -n "$wheel" ]; then
    [ -f "$wheel" ] || die "--nvshmem-wheel ($wheel) does not exist"
    "$PY" -m pip install -q --no-index --no-deps "$wheel"
  fi
  "$PY" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('nvidia.nvshmem') else 1)" \
    || die "NVSHMEM is not installed in $PY; pass --nvshmem-wheel nvidia_nvshmem_cu*.whl"
  unset NVSHMEM_DIR
  cuda=$(cuda_home)
  # CUDA 13 moved the CCCL headers (cuda/std/..., cub, thrust) under include/cccl.
  [ -d "$cuda/include/cccl" ] && export CPATH="$cuda/include/cccl${CPATH:+:$CPATH}"
  # torch's headers include the CUDA math libraries' (cusparse.h, cublas_v2.h); a toolkit without them
  # (nvcc alone) takes them from the nvidia-*-cu1x wheels torch brought.
  if [ ! -e "$cuda/include/cusparse.h" ]; then
    extra=$(pip_cuda_include) || die "cusparse.h is neither in $cuda/include nor in a nvidia-cusparse wheel of $PY"
    export CPATH="${CPATH:+$CPATH:}$extra"
  fi
  # DeepEP's configs.cuh and NVSHMEM's IBGDA header include infiniband/mlx5dv.h (headers only).
  if [ -n "$ibverbs" ]; then
    inc=$(ibverbs_include "$ibverbs" "$work")
    export CPATH="$inc${CPATH:+:$CPATH}"
  elif ! echo '#include <infiniband/mlx5dv.h>' | cc -E -x c - >/dev/null 2>&1; then
    die "infiniband/mlx5dv.h is not on the include path; pass --ibverbs libibverbs-dev_*.deb (tools/build_deep_ep.sh fetch)"
  fi
  # The extension links the driver library (-lcuda). A machine without a GPU driver links against an empty
  # stand-in with the driver's soname; the GPU host's driver provides libcuda.so.1 at run time.
  if ! echo 'int main(void) { return 0; }' | cc -x c - -lcuda -o "$work/link_check" >/dev/null 2>&1; then
    mkdir -p "$work/stubs"
    cc -shared -Wl,-soname,libcuda.so.1 -x c /dev/null -o "$work/stubs/libcuda.so" \
      || die "no libcuda.so to link against, and no stand-in could be made"
    export LIBRARY_PATH="$work/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
    # the stand-in defines no symbols, so keep the linker from dropping it (the cu* calls resolve at load time)
    export LDFLAGS="-Wl,--no-as-needed${LDFLAGS:+ $LDFLAGS}"
    echo "build_deep_ep: no GPU driver here; linking against a libcuda.so.1 stand-in"
  fi
  # NVSHMEM is found beside the installed extension (site-packages/nvidia/nvshmem/lib) on any host, not only
  # at this Python's absolute path, so the wheel can be carried to another machine.
  export LDFLAGS="-Wl,-rpath,\$ORIGIN/nvidia/nvshmem/lib${LDFLAGS:+ $LDFLAGS}"
  export CUDA_HOME="$cuda" TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
  echo "build_deep_ep: source $root, CUDA $cuda, arch $arch, $MAX_JOBS jobs"
  mkdir -p "$out"
  "$PY" -m pip wheel --no-build-isolation --no-deps --no-index -w "$out" "$root"
  local built
  built=$(ls -t "$out"/deep_ep-*.whl | head -1)
  echo "build_deep_ep: built $built in $((SECONDS - t0)) s"
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
