"""End to end inside real vLLM on the CPU: a tiny random Qwen3-MoE model (2 layers, 8 experts,
top-2) written locally, generated greedily with the moe-modular plugin off and on.

Skipped where vLLM is not installed (the main test environment); .ci/vllm_e2e.sh runs it in the
vLLM virtualenv. Every vLLM run is a subprocess (vLLM starts its engine and workers as processes
of their own); the plugin's switch MOE_MODULAR_ENABLE is set in its environment.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/vllm_e2e.sh runs this in its virtualenv")

from tests.vllm_e2e.generate import MAX_TOKENS, PROMPTS, cpu_bind_for_workers  # noqa: E402
from tests.vllm_e2e.make_tiny_moe import FP8_SPEC, TinyMoESpec, make_tiny_moe, make_tiny_moe_fp8  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_TIMEOUT_S = 480
SERVER_START_TIMEOUT_S = 480
KERNEL_LOG_LINE = "moe-modular: MoE layers run MoEPrepareAndFinalizeNoEP"
# The same float32 model through two kernels (vLLM's CPU grouped GEMM, moe-modular's float32
# experts): per-step log-probabilities differ by accumulation order only, a few float32 ulps of
# the O(1..10) logits, amplified by two layers; 1e-3 leaves room and still catches a wrong expert.
LOGPROB_ATOL = 1e-3


def _env(enable: bool) -> dict:
    env = dict(os.environ)
    # The test suite's Triton interpreter switch is not for vLLM's processes.
    env.pop("TRITON_INTERPRET", None)
    env["MOE_MODULAR_ENABLE"] = "1" if enable else "0"
    env["HF_HUB_OFFLINE"] = "1"
    # amx_site/sitecustomize.py: each process asks for the AMX state vLLM's CPU attention needs (its docstring)
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests", "vllm_e2e", "amx_site"),
                                         env.get("PYTHONPATH", "")])
    return env


def _tail(path: str, n: int = 60) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    spec = TinyMoESpec()
    assert (spec.num_layers, spec.num_experts, spec.topk) == (2, 8, 2)
    return make_tiny_moe(str(tmp_path_factory.mktemp("tiny_qwen3_moe")), spec)


def run_generate(model: str, workdir, name: str, enable: bool, tp: int = 1, ep: bool = False, extra=()):
    out, log = os.path.join(workdir, f"{name}.json"), os.path.join(workdir, f"{name}.log")
    cmd = [sys.executable, "-m", "tests.vllm_e2e.generate", model, out, "--tp", str(tp), *extra]
    if ep:
        cmd.append("--enable-expert-parallel")
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=_env(enable), stdout=f, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}; log tail:\n{_tail(log)}"
    with open(out) as f:
        record = json.load(f)
    with open(log, errors="replace") as f:
        record["log"] = f.read()
    print(f"{name}: {time.monotonic() - t0:.0f} s wall, {record['seconds']}, workers {record['workers']}")
    return record


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("vllm_runs"))


@pytest.fixture(scope="module")
def off_run(tiny_model, workdir):
    return run_generate(tiny_model, workdir, "plugin_off", enable=False)


@pytest.fixture(scope="module")
def on_run(tiny_model, workdir):
    return run_generate(tiny_model, workdir, "plugin_on", enable=True)


def _assert_same_generation(got, want):
    assert len(got["results"]) == len(want["results"]) == len(PROMPTS)
    for g, w in zip(got["results"], want["results"]):
        assert len(w["token_ids"]) == MAX_TOKENS
        assert g["token_ids"] == w["token_ids"], f"prompt {w['prompt']!r}: {g['text']!r} != {w['text']!r}"
        for step, (gs, ws) in enumerate(zip(g["logprobs"], w["logprobs"])):
            for tok, lp in ws.items():
                if tok in gs:
                    assert math.isclose(gs[tok], lp, abs_tol=LOGPROB_ATOL), (
                        f"prompt {w['prompt']!r} step {step} token {tok}: logprob {gs[tok]} vs {lp}")


def _assert_workers_ran_moe_modular(record, n_workers: int, n_layers: int = 2, min_calls: int = MAX_TOKENS):
    assert len(record["workers"]) == n_workers
    for stats in record["workers"]:
        assert stats["moe_modular_layers"] == n_layers and stats["vllm_layers"] == 0, stats
        # At least one forward per layer per generated token (a scoring run: one forward in all).
        assert stats["moe_modular_forward_calls"] >= n_layers * min_calls, stats
    worker_lines = [ln for ln in record["log"].splitlines() if KERNEL_LOG_LINE in ln and "Worker" in ln]
    # vLLM prints INFO lines from the first worker only; the stats above cover every worker.
    assert worker_lines, f"no worker logged {KERNEL_LOG_LINE!r}"


def test_plugin_off_runs_vllm_kernel(off_run):
    assert off_run["workers"] == [{"moe_modular_layers": 0, "vllm_layers": 2, "moe_modular_forward_calls": 0}]
    assert "plugin installed but disabled" in off_run["log"]
    # The prompts lead to different continuations, so the MoE layers shape the output.
    assert len({tuple(r["token_ids"]) for r in off_run["results"]}) == len(PROMPTS)


def test_plugin_on_matches_off(on_run, off_run):
    _assert_workers_ran_moe_modular(on_run, n_workers=1)
    _assert_same_generation(on_run, off_run)


def test_tensor_parallel_2_with_expert_parallel(tiny_model, workdir, off_run):
    """TP=2 + --enable-expert-parallel on one data-parallel rank: 2 EP ranks with 4 local experts
    each; every rank sees every token, moe-modular's single-rank kernel runs the local experts
    through vLLM's expert_map and vLLM all-reduces. (vLLM's own CPU MoE kernel segfaults here in
    vLLM 0.32.0, see docs/vllm.md, so the reference is the TP=1 run.)"""
    rec = run_generate(tiny_model, workdir, "tp2_ep_plugin_on", enable=True, tp=2, ep=True)
    assert "Local/global number of experts: 4/8" in rec["log"]
    _assert_workers_ran_moe_modular(rec, n_workers=2)
    _assert_same_generation(rec, off_run)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_json(url: str, payload=None, timeout: float = 10.0):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


SERVER_CASES = [
    # (name, extra server arguments, workers, PF the workers must log)
    ("tp1", [], 1, "MoEPrepareAndFinalizeNoEP"),                              # one rank, plain serving
    ("dp2_ep", ["--data-parallel-size", "2", "--enable-expert-parallel"], 2,  # 2 engines, tokens dispatched
     "AllGatherReduceScatterPrepareAndFinalize"),
]


@pytest.mark.parametrize("name,extra_args,workers,pf_name", SERVER_CASES)
def test_openai_server_with_plugin(tiny_model, workdir, off_run, name, extra_args, workers, pf_name):
    """The OpenAI-compatible server on 127.0.0.1 with the plugin on, queried once. With
    --data-parallel-size 2 --enable-expert-parallel each engine's worker runs moe-modular's
    all-gather/reduce-scatter PF over vLLM's EP process group (vLLM's own kernel stops there on
    the CPU: its CPU communicator has no all_gatherv, see docs/vllm.md)."""
    port = _free_port()
    log = os.path.join(workdir, f"server_{name}.log")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model,
           "--served-model-name", "tiny-moe", "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "256", "--host", "127.0.0.1", "--port", str(port), *extra_args]
    env = _env(True)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if workers > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind_for_workers(workers))
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as f:
        server = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            assert server.poll() is None, f"server exited {server.returncode}; log tail:\n{_tail(log)}"
            assert time.monotonic() < deadline, f"server not ready in {SERVER_START_TIMEOUT_S} s:\n{_tail(log)}"
            try:
                models = _http_json(f"{base}/v1/models", timeout=5)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(2)
        assert [m["id"] for m in models["data"]] == ["tiny-moe"]
        reply = _http_json(f"{base}/v1/completions", {
            "model": "tiny-moe", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True,
        }, timeout=300)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)
    text = reply["choices"][0]["text"]
    assert reply["usage"]["completion_tokens"] == MAX_TOKENS
    assert text.strip() == off_run["results"][0]["text"].strip()
    with open(log, errors="replace") as f:
        server_log = f.read()
    line = f"moe-modular: MoE layers run {pf_name}"
    logged = [ln for ln in server_log.splitlines() if line in ln and "Worker" in ln]
    assert len(logged) >= workers, f"{workers} worker(s) must log {line!r}:\n{_tail(log)}"


# ---- fp8: a 128 x 128 block checkpoint (quant_method "fp8") served through the plugin ----------------
# vLLM 0.32.0's CPU build has no fp8 MoE kernel for CPUs without AMX (it stops with "Unsupported FP8 MoE
# backend: NONE", docs/vllm.md), so the reference is the plugin's bf16 path on the dequantized weights
# (exact in bf16: power-of-two block scales). The runs differ by the fp8 path's activation quantization
# (1 x 128 groups, e4m3) and, where that moves a router's top-2 by a hair, by a different expert: so the
# fp8 run's sequences are scored by the dequantized model (teacher forcing) and compared on average.
# Measured (2026-12-07, this model): mean |logprob difference| 0.15, mean gap to the best token 0.06; with
# the gate scales of the experts rotated (a wiring error) 2.2 and 2.1.
FP8_MEAN_LOGPROB_TOL = 0.5
FP8_MEAN_GAP_TOL = 0.5
FP8_KERNEL_LOG_LINE = "quant=fp8-block128x128"


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory) -> tuple[str, str]:
    return make_tiny_moe_fp8(str(tmp_path_factory.mktemp("tiny_qwen3_moe_fp8")))


@pytest.fixture(scope="module")
def fp8_on_run(fp8_models, workdir):
    return run_generate(fp8_models[0], workdir, "fp8_plugin_on", enable=True, extra=["--dtype", "bfloat16"])


def _fp8_agreement(gen_run, scored_run) -> tuple[float, float]:
    """(mean |logprob of the generated token, generated - scored|, mean (best - generated token) logprob under
    the scoring model) over every generated position."""
    diffs, gaps = [], []
    for g, s in zip(gen_run["results"], scored_run["results"], strict=True):
        assert s["token_ids"] == g["token_ids"]
        for step, chosen, best in zip(g["logprobs"], s["chosen_logprobs"], s["best_logprobs"], strict=True):
            diffs.append(abs(max(step.values()) - chosen))
            gaps.append(best - chosen)
    assert len(diffs) == len(PROMPTS) * MAX_TOKENS
    return sum(diffs) / len(diffs), sum(gaps) / len(gaps)


def test_fp8_plugin_on_runs_moe_modular(fp8_on_run):
    _assert_workers_ran_moe_modular(fp8_on_run, n_workers=1)
    assert FP8_KERNEL_LOG_LINE in fp8_on_run["log"]


def test_fp8_generation_agrees_with_dequantized_bf16(fp8_models, workdir, fp8_on_run):
    scored = run_generate(fp8_models[1], workdir, "fp8_scored_by_dequantized", enable=True,
                          extra=["--dtype", "bfloat16", "--score", os.path.join(workdir, "fp8_plugin_on.json")])
    _assert_workers_ran_moe_modular(scored, n_workers=1, min_calls=1)
    diff, gap = _fp8_agreement(fp8_on_run, scored)
    print(f"fp8 against dequantized bf16: mean |logprob difference| {diff:.3f}, mean gap {gap:.3f}")
    assert diff <= FP8_MEAN_LOGPROB_TOL and gap <= FP8_MEAN_GAP_TOL, (diff, gap)


def test_fp8_agreement_catches_misplaced_scales(fp8_models, workdir):
    """The agreement check fails on a checkpoint whose experts' gate scales are rotated by one expert."""
    from safetensors.torch import load_file, save_file

    bad_dir = os.path.join(workdir, "fp8_rotated_scales")
    shutil.copytree(fp8_models[0], bad_dir, dirs_exist_ok=True)
    path = os.path.join(bad_dir, "model.safetensors")
    w = load_file(path)
    spec = FP8_SPEC
    for layer in range(spec.num_layers):
        keys = [f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight_scale_inv" for e in range(spec.num_experts)]
        scales = [w[k] for k in keys]
        w.update({k: scales[(i + 1) % len(keys)] for i, k in enumerate(keys)})
    save_file(w, path, metadata={"format": "pt"})
    bad = run_generate(bad_dir, workdir, "fp8_rotated_on", enable=True, extra=["--dtype", "bfloat16"])
    scored = run_generate(fp8_models[1], workdir, "fp8_rotated_scored", enable=True,
                          extra=["--dtype", "bfloat16", "--score", os.path.join(workdir, "fp8_rotated_on.json")])
    diff, gap = _fp8_agreement(bad, scored)
    assert diff > FP8_MEAN_LOGPROB_TOL and gap > FP8_MEAN_GAP_TOL, (diff, gap)
