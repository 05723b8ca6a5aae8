"""Write a tiny random-weight Qwen3-MoE checkpoint and a word-level tokenizer to a folder.

Nothing is downloaded: the config and tokenizer are built here and written with save_pretrained,
the seeded weights with safetensors (no model class is imported), so vLLM can load the folder with HF_HUB_OFFLINE=1.

    python -m tests.vllm_e2e.make_tiny_moe OUT_DIR [--experts 8] [--topk 2] [--layers 2] [--seed 0]
    python -m tests.vllm_e2e.make_tiny_moe OUT_DIR --fp8-block   # OUT_DIR/fp8 and OUT_DIR/dequantized

--fp8-block writes two checkpoints of one model: `fp8` with the expert weights in fp8 e4m3 with 128 x 128
block scales (quant_method "fp8", as DeepSeek-V3 ships; the other layers stay unquantized), and `dequantized`
with those expert weights multiplied back out in float32. The block scales are powers of two, so the
dequantized weights are exact in bf16 too: the two models differ only in the fp8 path's activation
quantization.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace

VOCAB_WORDS = 500  # ordinary tokens "w0" .. "w499"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")


@dataclass(frozen=True)
class TinyMoESpec:
    """The model's sizes; the defaults give a 2-layer, 8-expert, top-2 model of a few MB."""

    num_layers: int = 2
    num_experts: int = 8
    topk: int = 2
    hidden_size: int = 64
    moe_intermediate_size: int = 32
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 512
    seed: int = 0


def prompt_words(n: int, offset: int = 0) -> str:
    """A prompt of n vocabulary words (the tokenizer maps each to one id)."""
    return " ".join(f"w{(offset + 7 * i) % VOCAB_WORDS}" for i in range(n))


def _write_tokenizer(out_dir: str):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i in range(VOCAB_WORDS):
        vocab[f"w{i}"] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    )
    fast.save_pretrained(out_dir)
    return fast, len(vocab)


def _random_weights(cfg, spec: TinyMoESpec) -> dict:
    """Checkpoint tensors under the Hugging Face Qwen3-MoE names (per-expert gate/up/down)."""
    import torch

    g = torch.Generator().manual_seed(spec.seed)
    H, V, I = cfg.hidden_size, cfg.vocab_size, spec.moe_intermediate_size
    q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim

    def rnd(*shape, std=0.2):
        return (torch.randn(*shape, generator=g) * std).contiguous()

    def norm(n):
        return (1.0 + 0.1 * torch.randn(n, generator=g)).contiguous()

    w = {"model.embed_tokens.weight": rnd(V, H, std=1.0), "model.norm.weight": norm(H), "lm_head.weight": rnd(V, H)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = norm(H)
        w[f"{p}.post_attention_layernorm.weight"] = norm(H)
        w[f"{p}.self_attn.q_proj.weight"] = rnd(q_dim, H)
        w[f"{p}.self_attn.k_proj.weight"] = rnd(kv_dim, H)
        w[f"{p}.self_attn.v_proj.weight"] = rnd(kv_dim, H)
        w[f"{p}.self_attn.o_proj.weight"] = rnd(H, q_dim)
        w[f"{p}.self_attn.q_norm.weight"] = norm(spec.head_dim)
        w[f"{p}.self_attn.k_norm.weight"] = norm(spec.head_dim)
        # A wide router so that the top-2 choice differs between tokens.
        w[f"{p}.mlp.gate.weight"] = rnd(spec.num_experts, H, std=1.0)
        for e in range(spec.num_experts):
            w[f"{p}.mlp.experts.{e}.gate_proj.weight"] = rnd(I, H, std=0.5)
            w[f"{p}.mlp.experts.{e}.up_proj.weight"] = rnd(I, H, std=0.5)
            w[f"{p}.mlp.experts.{e}.down_proj.weight"] = rnd(H, I, std=0.5)
    return w


FP8_BLOCK = 128
FP8_MAX = 448.0
# sizes of the fp8 model: hidden and expert intermediate sizes are whole 128 x 128 blocks
FP8_SPEC = TinyMoESpec(hidden_size=128, moe_intermediate_size=128)


def _expert_weight_names(spec: TinyMoESpec) -> list[str]:
    return [f"model.layers.{i}.mlp.experts.{e}.{proj}.weight" for i in range(spec.num_layers)
            for e in range(spec.num_experts) for proj in ("gate_proj", "up_proj", "down_proj")]


def quantize_block_pow2(w):
    """(fp8 e4m3 weight, float32 scales (out/128, in/128), float32 dequantized weight) of a 2-D float weight
    whose sizes are multiples of 128: one power-of-two scale per 128 x 128 block, the smallest with
    |w| / scale <= 448."""
    import torch

    o, i = w.shape
    blocks = w.reshape(o // FP8_BLOCK, FP8_BLOCK, i // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    deq = (q.float() * scale[:, None, :, None]).reshape(o, i)
    return q.reshape(o, i), scale.float(), deq


# Expert e's projections scaled by EXPERT_GAIN * 2 ** (e % 4 - 1) (up_proj twice that): the experts' and the
# gate/up halves' block scales then differ by powers of two, so a scale applied to the wrong expert or half
# changes the output (random weights of one magnitude would give nearly one scale everywhere).
EXPERT_GAIN = 0.25


def _vary_expert_magnitudes(weights: dict, spec: TinyMoESpec) -> dict:
    out = dict(weights)
    for key in _expert_weight_names(spec):
        e = int(key.split(".experts.")[1].split(".")[0])
        gain = EXPERT_GAIN * 2.0 ** (e % 4 - 1) * (2.0 if ".up_proj." in key else 1.0)
        out[key] = weights[key] * gain
    return out


def _config(spec: TinyMoESpec, tok, vocab_size: int, dtype: str):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=4 * spec.hidden_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.topk,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype=dtype,
    )
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg


def make_tiny_moe(out_dir: str, spec: TinyMoESpec = TinyMoESpec()) -> str:
    """Write config.json, model.safetensors (float32) and the tokenizer to out_dir; return out_dir."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tok, vocab_size = _write_tokenizer(out_dir)
    cfg = _config(spec, tok, vocab_size, "float32")
    cfg.save_pretrained(out_dir)
    save_file(_random_weights(cfg, spec), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def make_tiny_moe_fp8(out_dir: str, spec: TinyMoESpec = FP8_SPEC) -> tuple[str, str]:
    """Write the fp8 block checkpoint to out_dir/fp8 and its dequantized twin to out_dir/dequantized (module
    docstring); return both folders."""
    from safetensors.torch import save_file

    if spec.hidden_size % FP8_BLOCK or spec.moe_intermediate_size % FP8_BLOCK:
        raise ValueError(f"fp8 block checkpoint needs hidden_size ({spec.hidden_size}) and moe_intermediate_size "
                         f"({spec.moe_intermediate_size}) to be multiples of {FP8_BLOCK}")
    fp8_dir, deq_dir = os.path.join(out_dir, "fp8"), os.path.join(out_dir, "dequantized")
    for d in (fp8_dir, deq_dir):
        os.makedirs(d, exist_ok=True)
    tok, vocab_size = _write_tokenizer(fp8_dir)
    _write_tokenizer(deq_dir)
    cfg = _config(spec, tok, vocab_size, "bfloat16")
    weights = _vary_expert_magnitudes(_random_weights(cfg, spec), spec)
    fp8_weights, deq_weights = dict(weights), dict(weights)
    for key in _expert_weight_names(spec):
        q, scale, deq = quantize_block_pow2(weights[key])
        fp8_weights[key] = q
        fp8_weights[key.replace(".weight", ".weight_scale_inv")] = scale
        deq_weights[key] = deq
    cfg.save_pretrained(deq_dir)
    save_file(deq_weights, os.path.join(deq_dir, "model.safetensors"), metadata={"format": "pt"})
    # Only the routed experts are fp8: attention, router and lm_head stay as they are.
    ignored = ["lm_head"] + [f"model.layers.{i}.{m}" for i in range(spec.num_layers)
                             for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                       "self_attn.o_proj", "mlp.gate")]
    cfg.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "ignored_layers": ignored}
    cfg.save_pretrained(fp8_dir)
    save_file(fp8_weights, os.path.join(fp8_dir, "model.safetensors"), metadata={"format": "pt"})
    return fp8_dir, deq_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--experts", type=int, default=TinyMoESpec.num_experts)
    ap.add_argument("--topk", type=int, default=TinyMoESpec.topk)
    ap.add_argument("--layers", type=int, default=TinyMoESpec.num_layers)
    ap.add_argument("--seed", type=int, default=TinyMoESpec.seed)
    ap.add_argument("--fp8-block", action="store_true", help="the fp8 block checkpoint and its dequantized twin")
    a = ap.parse_args()
    base = FP8_SPEC if a.fp8_block else TinyMoESpec()
    spec = replace(base, num_layers=a.layers, num_experts=a.experts, topk=a.topk, seed=a.seed)
    print(make_tiny_moe_fp8(a.out_dir, spec) if a.fp8_block else make_tiny_moe(a.out_dir, spec))


if __name__ == "__main__":
    main()
