"""A Llama checkpoint made on the spot (random weights, fixed seed, no
download): tiny for the engine tests, Llama-shaped and >= 1 GiB for
bench/serving.py; a tiny Mixtral (a mixture of experts) likewise. ``python tiny_llama.py OUT [--layers N ...]``."""

from __future__ import annotations

import argparse
from pathlib import Path


def make(out: Path, *, layers: int = 2, hidden: int = 64, intermediate: int = 128, vocab: int = 512,
         shard_size: str = "5GB", seed: int = 0) -> Path:
    """Writes a Llama with these dimensions to ``out`` (config.json and
    safetensors shards of at most ``shard_size``) and returns ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=max(2, hidden // 64),
        num_key_value_heads=max(1, hidden // 256),
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():  # big enough weights that tokens differ
            p.normal_(0.0, 0.5 if p.dim() == 1 else 0.2)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=shard_size)
    return out


def make_mixtral(out: Path, *, layers: int = 2, hidden: int = 64, intermediate: int = 96, experts: int = 4,
                 vocab: int = 512, shard_size: str = "5GB", seed: int = 0) -> Path:
    """Writes a Mixtral (a mixture of ``experts`` experts, two per token)
    with these dimensions to ``out``, as :func:`make` does, and returns it."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=max(2, hidden // 64),
        num_key_value_heads=max(1, hidden // 256),
        num_local_experts=experts,
        num_experts_per_tok=2,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = MixtralForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5 if p.dim() == 1 else 0.2)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=shard_size)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--shard-size", default="5GB")
    a = ap.parse_args()
    print(make(a.out, layers=a.layers, hidden=a.hidden, intermediate=a.intermediate, vocab=a.vocab, shard_size=a.shard_size))
