"""Tiny models built from a config (nothing read from disk)."""


def tiny_llama(layers: int = 2):
    """A Llama of ``layers`` decoder layers (hidden 32, 4 heads, 2 kv heads, untied head), seeded, built from its
    config (nothing read)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)
