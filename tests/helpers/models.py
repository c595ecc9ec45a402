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


def tiny_moe(layers: int = 2, experts_implementation: str = "eager", seed: int = 0, vocab: int = 96,
             router_std: float = 0.5, expert_std: float = None):
    """A Qwen3-MoE of ``layers`` sparse layers (hidden 32, 4 heads, head_dim 8, 4 experts, top-2,
    router_aux_loss_coef 0.01, untied head), seeded, built from its config (nothing read).  ``router_std``: the
    router weights' spread (0.5: routing is decided; None keeps transformers' 0.02 init, near-ties everywhere, as
    an untrained router has); ``expert_std``: the experts' (None: transformers' 0.02; larger makes the choice of
    expert matter to the output)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.01,
                         tie_word_embeddings=False, experts_implementation=experts_implementation)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight") and router_std is not None:
                p.normal_(0, router_std)
            if ".mlp.experts." in name and expert_std is not None:
                p.normal_(0, expert_std)
    return model
