#!/usr/bin/env bash
# The GPU subset on one CUDA machine: the combinations matrix at world size 1 (CUDA tensors; the
# EP PFs over a one-rank NCCL group), a larger-shape pass of the Triton experts, the EP backend
# checks (symmetric-memory refusal, DeepEP), and the profiler. Logs and traces go to ${OUT:-out}.
#   bash tools/gpu_subset.sh                          # every step (about 11 minutes on one H200)
#   bash tools/gpu_subset.sh matrix_ws1 pytest_gpu    # only the named steps
set -uo pipefail
steps="matrix_ws1 check_ep_gpu profile profile_a2a matrix_triton_large matrix_batched_large matrix_a2a_large pytest_gpu"
for want in "$@"; do
  case " $steps " in
    *" $want "*) ;;
    *) echo "gpu_subset.sh: unknown step '$want'; allowed: $steps" >&2; exit 2 ;;
  esac
done
selected=" ${*:-$steps} "
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-out}
mkdir -p "$out"
status=0
step() {  # name, time limit in seconds, command...
  local name=$1 limit=$2; shift 2
  case "$selected" in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || status=1
  printf '%-28s rc=%d %4ds  %s\n' "$name" "$rc" $((SECONDS - t0)) "$(tail -n 1 "$out/$name.log")" | tee -a "$out/summary.txt"
}
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' | tee "$out/summary.txt"
step matrix_ws1 240 python3 -m tests.test_modular_kernel_combinations --world-size 1 --full
step check_ep_gpu 60 python3 -m tools.check_ep_gpu --out "$out"
step profile 90 python3 -m tools.profile_modular_kernel --pf-type MoEPrepareAndFinalizeNoEP --experts-type TritonExperts \
  -m 1 64 1024 -k 2048 -n 768 --num-experts 128 --topk 8 --torch-trace-dir-path "$out/traces"
step profile_a2a 60 python3 -m tools.profile_modular_kernel --pf-type AllToAllPrepareAndFinalize --experts-type TritonExperts \
  -m 64 -k 2048 -n 768 --num-experts 32 --topk 4 --torch-trace-dir-path "$out/traces"
step matrix_triton_large 240 python3 -m tests.test_modular_kernel_combinations --pf-type MoEPrepareAndFinalizeNoEP \
  --experts-type TritonExperts -m 1 33 512 -k 2048 -n 768 --num-experts 64 --topk 1 8
step matrix_batched_large 60 python3 -m tests.test_modular_kernel_combinations --pf-type BatchedPrepareAndFinalize \
  --experts-type BatchedTritonExperts -m 1 33 256 -k 1024 -n 384 --num-experts 16 --topk 2
step matrix_a2a_large 60 python3 -m tests.test_modular_kernel_combinations --pf-type AllToAllPrepareAndFinalize \
  --experts-type TritonExperts -m 1 64 -k 2048 -n 768 --num-experts 32 --topk 4
step pytest_gpu 330 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_experts.py tests/test_triton_kernels.py tests/test_quant.py \
  tests/test_grouped_mm_experts.py tests/test_modular_kernel.py tests/test_fused_moe_layer.py tests/test_input_validation.py tests/test_launcher.py
cat "$out/summary.txt"
exit $status
