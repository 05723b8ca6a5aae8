"""Write a tiny random-weight Qwen3-MoE checkpoint and a word-level tokenizer to a folder.

Nothing is downloaded: the config and tokenizer are built here and written with save_pretrained,
the seeded weights with safetensors (no model class is imported), so vLLM can load the folder with HF_HUB_OFFLINE=1.

    python -m tests.vllm_e2e.make_tiny_moe OUT_DIR [--experts 8] [--topk 2] [--layers 2] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

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


def make_tiny_moe(out_dir: str, spec: TinyMoESpec = TinyMoESpec()) -> str:
    """Write config.json, model.safetensors (float32) and the tokenizer to out_dir; return out_dir."""
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    os.makedirs(out_dir, exist_ok=True)
    tok, vocab_size = _write_tokenizer(out_dir)
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
        dtype="float32",
    )
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.save_pretrained(out_dir)
    save_file(_random_weights(cfg, spec), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--experts", type=int, default=TinyMoESpec.num_experts)
    ap.add_argument("--topk", type=int, default=TinyMoESpec.topk)
    ap.add_argument("--layers", type=int, default=TinyMoESpec.num_layers)
    ap.add_argument("--seed", type=int, default=TinyMoESpec.seed)
    a = ap.parse_args()
    spec = TinyMoESpec(num_layers=a.layers, num_experts=a.experts, topk=a.topk, seed=a.seed)
    print(make_tiny_moe(a.out_dir, spec))


if __name__ == "__main__":
    main()
