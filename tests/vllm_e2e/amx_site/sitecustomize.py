"""Run at the start of every Python process of the vLLM end-to-end runs (tests/test_vllm_e2e.py puts this folder on
their PYTHONPATH).

vLLM's CPU attention takes its AMX kernel where the CPU reports AMX tiles, and Linux lets a process use AMX tiles
only after it has asked for their register state. In an fp8 model's worker process nothing asks before the first
attention (the bf16 models' oneDNN matmuls do), so the worker dies of SIGILL (exit code -4) in
`cpu_attention_with_kv_cache`, with or without moe-modular. Asking once per process, as torch does for its own AMX
kernels, keeps those runs about the MoE layer.
"""
import torch

if torch.cpu._is_amx_tile_supported():
    torch.cpu._init_amx()
