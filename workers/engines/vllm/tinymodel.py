"""Write a tiny random-weight Llama as a local Hugging Face model directory, for tests and the CPU demo.

Nothing is downloaded: the weights are random (seeded), there is no tokenizer (prompts are token ids).
head_dim = hidden / heads must be at least 64 for vLLM's CPU attention kernel.

    python -m workers.engines.vllm.tinymodel DIR
"""

from __future__ import annotations

import sys
from pathlib import Path


def write_tiny_llama(
    path: str | Path,
    *,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    vocab: int = 512,
    max_len: int = 2048,
    seed: int = 0,
) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden // heads < 64:
        raise ValueError("head_dim (hidden / heads) must be at least 64 for vLLM's CPU attention")
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=layers,
        vocab_size=vocab,
        max_position_embeddings=max_len,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bfloat16, saved as bfloat16
    try:
        model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    out = Path(path)
    model.save_pretrained(out)
    return out


if __name__ == "__main__":
    print(write_tiny_llama(sys.argv[1]))
