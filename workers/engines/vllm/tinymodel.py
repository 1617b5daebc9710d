"""Write a tiny random-weight Llama as a local Hugging Face model directory, for tests and the CPU demo.

Nothing is downloaded: the weights are random (seeded) and the tokenizer is a byte-level BPE trained here,
in a fraction of a second, on sentences built from a fixed word list, to exactly the model's vocabulary
(so every id the model can emit decodes). It has `<s>` (bos), `</s>` (eos, also the model's
`eos_token_id`) and one special token per chat role, and ships a chat template. head_dim = hidden / heads
must be at least 64 for vLLM's CPU attention kernel.

    python -m workers.engines.vllm.tinymodel DIR               # model + tokenizer (needs torch, transformers)
    python -m workers.engines.vllm.tinymodel --tokenizer-only DIR  # the tokenizer alone (needs tokenizers)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIAL = ("<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
BOS, EOS = 0, 1  # ids of <s> and </s> (special tokens come first in the vocabulary)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_WORDS = (  # noqa: SIM905 - a paragraph reads better than 200 quoted words
    "the a of to and in is it you that he was for on are with as his they be at one have this from or "
    "had by word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long make thing "
    "see him two has look more day could go come did number sound no most people my over know water than "
    "call first who may down side been now find any new work part take get place made live where after "
    "back little only round man year came show every good me give our under name very through just form "
    "sentence great think say help low line differ turn cause much mean before move right boy old too "
    "same tell does set three want air well also play small end put home read hand port large spell add "
    "even land here must big high such follow act why ask men change went light kind off need house "
    "picture try us again animal point mother world near build self earth father"
).split()
_EXTRA = (
    "Grüße aus Zürich — naïve café, 東京 and 🙂 emoji.",
    "Tetri serves language models: prefill, decode, KV cache; 100% on the CPU.",
)


def words(seed: int, n: int) -> list[str]:
    """`n` words of the tokenizer's corpus vocabulary, a fixed sequence per seed (for prompts in tests)."""
    return [_WORDS[(seed * k + k * k) % len(_WORDS)] for k in range(1, n + 1)]


def _corpus() -> list[str]:
    n = len(_WORDS)
    return [" ".join(_WORDS[(i * k) % n] for k in range(1, 12)) + "." for i in range(400)] + list(_EXTRA)


def write_tiny_tokenizer(path: str | Path, *, vocab: int = 512, max_len: int = 2048) -> Path:
    """A byte-level BPE tokenizer of exactly `vocab` ids with a chat template, as tokenizer.json and
    tokenizer_config.json (what `transformers`, vLLM and Tetri's daemon load)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    if tok.get_vocab_size() != vocab or tok.token_to_id("</s>") != EOS:
        raise RuntimeError(f"tiny tokenizer came out with {tok.get_vocab_size()} ids, wanted {vocab}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    return out


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
        bos_token_id=BOS,
        eos_token_id=EOS,
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
    write_tiny_tokenizer(out, vocab=vocab, max_len=max_len)
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--tokenizer-only"]:
        print(write_tiny_tokenizer(sys.argv[2]))
    else:
        print(write_tiny_llama(sys.argv[1]))
