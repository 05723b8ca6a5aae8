"""Greedy offline generation with vLLM on the CPU; writes tokens, logprobs and kernel stats as JSON.

    python -m tests.vllm_e2e.generate MODEL_DIR OUT_JSON [--tp 2] [--enable-expert-parallel] [--dtype bfloat16]
    python -m tests.vllm_e2e.generate MODEL_DIR OUT_JSON --score RUN_JSON [--dtype bfloat16]

Whether moe-modular runs is decided by MOE_MODULAR_ENABLE in the environment (the plugin reads it
in every vLLM process). The JSON holds, per prompt, the generated token ids and the top
logprobs of each step, and per worker the counts of `kernel_stats` (layers on moe-modular's
kernel, layers on vLLM's, forwards served by moe-modular).

--score RUN_JSON scores another run's sequences (prompt + generated tokens) with this model instead of
generating (teacher forcing): per generated position, the logprob of the token that run chose and this
model's best logprob there.
"""
from __future__ import annotations

import argparse
import json
import os
import time

PROMPTS = ("w1 w2 w3 w4", "w10 w20 w30", "w400 w5", "w7")
MAX_TOKENS = 12
LOGPROBS = 3


def cpu_bind_for_workers(n: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND value giving each of n workers its own slice of this process's CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < n:
        raise RuntimeError(f"{n} vLLM CPU workers need at least {n} CPUs, this process may use {len(cpus)}")
    per = len(cpus) // n
    slices = [cpus[i * per:(i + 1) * per] for i in range(n)]
    return "|".join(",".join(str(c) for c in s) for s in slices)


def set_cpu_env(world_size: int) -> None:
    """Environment vLLM's CPU backend needs here: small KV cache, explicit thread binding when
    several workers share the machine (its automatic NUMA binding refuses 2 workers on 1 node)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if world_size > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind_for_workers(world_size))


def score(llm, run_json: str) -> list[dict]:
    """Teacher-forced logprobs of another run's generated tokens under this model (module docstring)."""
    from vllm import SamplingParams

    with open(run_json) as f:
        run = json.load(f)["results"]
    seqs = [{"prompt_token_ids": r["prompt_token_ids"] + r["token_ids"]} for r in run]
    outs = llm.generate(seqs, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=LOGPROBS))
    results = []
    for r, o in zip(run, outs):
        n = len(r["prompt_token_ids"])
        chosen, best = [], []
        for pos, tok in enumerate(r["token_ids"], start=n):
            step = o.prompt_logprobs[pos]
            chosen.append(step[tok].logprob)
            best.append(max(lp.logprob for lp in step.values()))
        results.append({"prompt": r["prompt"], "token_ids": r["token_ids"], "chosen_logprobs": chosen,
                        "best_logprobs": best})
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--enable-expert-parallel", action="store_true")
    ap.add_argument("--dtype", default="float32", help="vLLM's model dtype (fp8 checkpoints: bfloat16)")
    ap.add_argument("--score", metavar="RUN_JSON", help="score the sequences of this run instead of generating")
    a = ap.parse_args()
    set_cpu_env(a.tp)
    # apply_model sends kernel_stats to the workers by pickle, which vLLM allows only when asked.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

    t0 = time.monotonic()
    from vllm import LLM, SamplingParams

    from moe_modular.integrations.vllm import kernel_stats

    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=256, enforce_eager=True, seed=0,
              tensor_parallel_size=a.tp, enable_expert_parallel=a.enable_expert_parallel)
    t1 = time.monotonic()
    if a.score:
        results = score(llm, a.score)
    else:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=LOGPROBS, ignore_eos=True)
        outs = llm.generate(list(PROMPTS), params)
        results = []
        for o in outs:
            c = o.outputs[0]
            steps = [{str(tok): lp.logprob for tok, lp in step.items()} for step in (c.logprobs or [])]
            results.append({"prompt": o.prompt, "prompt_token_ids": list(o.prompt_token_ids),
                            "token_ids": list(c.token_ids), "text": c.text, "logprobs": steps})
    t2 = time.monotonic()
    record = {
        "moe_modular_enable": os.environ.get("MOE_MODULAR_ENABLE", ""),
        "tp": a.tp,
        "enable_expert_parallel": a.enable_expert_parallel,
        "results": results,
        "workers": llm.apply_model(kernel_stats),
        "seconds": {"init": t1 - t0, "generate": t2 - t1},
    }
    with open(a.out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps({k: record[k] for k in ("workers", "seconds")}))


if __name__ == "__main__":
    main()
