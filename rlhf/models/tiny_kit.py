"""Write an offline tiny kit: causal LM, reward model, tokenizer, task data.

    python -m rlhf.models.tiny_kit --out DIR [--arch llama|qwen2|qwen3_moe] [--layers 2] [--hidden 64] [--heads 4] [--tie]
    python -m rlhf.models.tiny_kit --out DIR --shape real     # shaped like a real small chat checkpoint

DIR            HF causal LM + tokenizer (AutoModelForCausalLM.from_pretrained(DIR))
DIR/reward     HF sequence-classification reward model + tokenizer
DIR/data       prompts_train/eval.jsonl, sft_train/eval.jsonl, pref_train/eval.jsonl

``--shape real`` (``make_real``): what a small chat checkpoint (Qwen2.5-0.5B-Instruct, SmolLM2-Instruct) brings
and the tiny kit does not: a 32768-entry byte-level BPE vocabulary with the special tokens at its end, a ChatML
chat template, pad == eos == the end-of-turn token ``<|im_end|>`` (also generation_config.json's eos), a tied LM
head, GQA (2 query heads over 1 key/value head, head_dim 32 so vLLM's CPU attention runs it), Qwen2's q/k/v
biases; its data are chat messages (prompts as ``[{"role": "user", ...}]``, responses as assistant message lists),
so every trainer needs ``--apply_chat_template``.  Small in layers and width: the 32k vocabulary dominates (2.1M
of its 2.2M parameters).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import click

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
# head_dim 32: the smallest vLLM's CPU attention supports; tied LM head like most small Qwen2.5 / Llama-3.2 / SmolLM
# checkpoints (the weight sync must then send the head vLLM keeps apart; issue 26 item 1)
VLLM_KIT = dict(hidden=128, heads=4, kv_heads=2, tie=True)
# the real-shaped kit (make_real): ChatML specials at the end of the vocabulary, as Qwen2 keeps them
REAL_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
END_OF_TURN = "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
REAL_KIT = dict(vocab_size=32768, layers=2, hidden=64, heads=2, kv_heads=1)
# the MoE kit (--arch qwen3_moe): Qwen3-MoE with 4 experts, top-2, in every layer (issue 45)
MOE_KIT = dict(experts=4, top_k=2)
DEFAULT_KIT = os.path.join(os.path.expanduser(os.environ.get("RLHF_CACHE", "~/.cache/rlhf")), "tiny-llama-v1")


def build_tokenizer(vocab_size: int = 160):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from rlhf.data.arithmetic import corpus

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_config(arch: str, vocab: int, layers: int, hidden: int, tok, heads: int = 4, kv_heads: int = 2,
                 tie: bool = False):
    from transformers import LlamaConfig, Qwen2Config

    if hidden % heads or heads % kv_heads:
        raise ValueError(f"--hidden {hidden} must be a multiple of --heads {heads}, and --heads of --kv_heads {kv_heads}")
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  tie_word_embeddings=tie)
    if arch == "qwen3_moe":  # MOE_KIT: every layer sparse, E experts, top-k (issue 45)
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**common, head_dim=hidden // heads, num_experts=MOE_KIT["experts"],
                              num_experts_per_tok=MOE_KIT["top_k"], moe_intermediate_size=hidden,
                              norm_topk_prob=True, router_aux_loss_coef=0.01)
    return (Qwen2Config if arch == "qwen2" else LlamaConfig)(**common)


@contextlib.contextmanager
def staged_dir(out: str, prefix: str):
    """A temp folder beside ``out``, renamed to ``out`` (replacing it) when the block succeeds, removed otherwise:
    a kit is never seen half-written."""
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield tmp
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def make_tiny(out: str, arch: str = "llama", layers: int = 2, hidden: int = 64, seed: int = 0, heads: int = 4,
              kv_heads: int = 2, tie: bool = False) -> str:
    """Build the kit into ``out`` atomically (temp dir + rename); returns ``out``.

    The default kit has head_dim 16 (hidden 64 / 4 heads); vLLM's CPU attention needs head_dim >= 32:
    ``make_tiny(out, hidden=128)`` (= VLLM_KIT) builds a kit vLLM runs.  ``tie``: the policy's LM head shares the
    input embedding (``tie_word_embeddings``, saved once); the reward model is never tied."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf.data import arithmetic as tasks

    torch.manual_seed(seed)
    with staged_dir(out, ".tiny-") as tmp:
        tok = build_tokenizer()
        cfg = build_config(arch, len(tok), layers, hidden, tok, heads, kv_heads, tie)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        rm_cfg = build_config(arch, len(tok), layers, hidden, tok, heads, kv_heads)
        rm_cfg.num_labels = 1
        rm_dir = os.path.join(tmp, "reward")
        AutoModelForSequenceClassification.from_config(rm_cfg).save_pretrained(rm_dir)
        tok.save_pretrained(rm_dir)
        data = os.path.join(tmp, "data")
        os.makedirs(data)
        for split, n, s in (("train", 2000, seed + 10), ("eval", 64, seed + 99)):
            tasks.write_jsonl(os.path.join(data, f"prompts_{split}.jsonl"), tasks.arithmetic_prompts(n, s))
            tasks.write_jsonl(os.path.join(data, f"sft_{split}.jsonl"), tasks.sft_rows(n, s + 1))
            tasks.write_jsonl(os.path.join(data, f"pref_{split}.jsonl"), tasks.preference_rows(n, s + 2))
    return out


def build_real_tokenizer(vocab_size: int = REAL_KIT["vocab_size"]):
    """A byte-level BPE tokenizer of ``vocab_size`` entries, built (not trained: instant and deterministic): the 256
    byte symbols, then two-symbol merges (printable ASCII, space and newline first, so text encodes in about half
    as many tokens as characters), then the ChatML specials (REAL_SPECIAL) at the end of the vocabulary.  Digits
    are split one by one (as Qwen2 and Llama 3 do).  eos = pad = ``<|im_end|>``, no bos (Qwen2.5-Instruct's
    tokenizer has none); ChatML chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    common = set(chr(c) for c in range(33, 127)) | {"\u0120", "\u010a"}  # byte-level space (G-dot), newline (C-dot)
    symbols = sorted(alphabet, key=lambda c: (c not in common, c))
    n_merges = vocab_size - len(symbols) - len(REAL_SPECIAL)
    if n_merges < 0:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the {len(symbols) + len(REAL_SPECIAL)} byte symbols "
                         f"and special tokens")
    vocab = {c: i for i, c in enumerate(symbols)}
    merges = [(a, b) for a in symbols for b in symbols][:n_merges]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in REAL_SPECIAL])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END_OF_TURN, pad_token=END_OF_TURN,
                                   padding_side="right")
    fast.chat_template = CHATML_TEMPLATE
    assert len(fast) == vocab_size and fast.pad_token_id == fast.eos_token_id == vocab_size - 1
    return fast


def real_rows(n: int, seed: int):
    """(prompt rows, SFT rows, preference rows) of the arithmetic task as chat messages, OpenRLHF's formats: the
    prompt a message list (every third with a system turn first), responses assistant message lists."""
    from rlhf.data import arithmetic as tasks

    prompts, sft, pref = [], [], []
    for i, r in enumerate(tasks.preference_rows(n, seed)):
        msgs = ([{"role": "system", "content": "You are a helpful assistant."}] if i % 3 == 0 else []) + \
            [{"role": "user", "content": r["input"]}]
        say = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
        prompts.append({"input": msgs, "label": r["label"]})
        sft.append({"input": msgs, "output": say(r["chosen"]), "label": r["label"]})
        pref.append({"input": msgs, "chosen": say(r["chosen"]), "rejected": say(r["rejected"]), "label": r["label"]})
    return prompts, sft, pref


def make_real(out: str, seed: int = 0, n_train: int = 512, n_eval: int = 32, vocab_size: int = REAL_KIT["vocab_size"],
              layers: int = REAL_KIT["layers"], hidden: int = REAL_KIT["hidden"], heads: int = REAL_KIT["heads"],
              kv_heads: int = REAL_KIT["kv_heads"]) -> str:
    """The real-shaped kit (module docstring, ``--shape real``) into ``out``, atomically; returns ``out``.

    Qwen2 architecture; generation_config.json's eos and pad are ``<|im_end|>`` (transformers' ``generate`` and vLLM
    stop there); the reward model (untied, ``num_labels=1``) has pad_token_id == eos, so transformers' own pooling
    ("last non-pad token") would read the token before the eos: scores must come from the attention mask."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig, Qwen2Config

    from rlhf.data import arithmetic as tasks

    torch.manual_seed(seed)
    with staged_dir(out, ".real-") as tmp:
        tok = build_real_tokenizer(vocab_size)
        eot = tok.eos_token_id
        cfg = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                   num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                   bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), eos_token_id=eot, pad_token_id=eot)
        model = AutoModelForCausalLM.from_config(Qwen2Config(tie_word_embeddings=True, **cfg))
        model.generation_config = GenerationConfig(eos_token_id=eot, pad_token_id=eot,
                                                   bos_token_id=cfg["bos_token_id"])
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        rm_dir = os.path.join(tmp, "reward")
        AutoModelForSequenceClassification.from_config(Qwen2Config(tie_word_embeddings=False, num_labels=1,
                                                                   **cfg)).save_pretrained(rm_dir)
        tok.save_pretrained(rm_dir)
        data = os.path.join(tmp, "data")
        os.makedirs(data)
        for split, n, s in (("train", n_train, seed + 10), ("eval", n_eval, seed + 99)):
            for kind, rows in zip(("prompts", "sft", "pref"), real_rows(n, s)):
                tasks.write_jsonl(os.path.join(data, f"{kind}_{split}.jsonl"), rows)
    return out


def ensure_tiny(path: str = DEFAULT_KIT) -> str:
    """Return the built-in kit, building it once (file-locked, so concurrent ranks don't race)."""
    import fcntl

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(path, "config.json")):
            make_tiny(path)
    return path


@click.command()
@click.option("--out", required=True, help="output directory")
@click.option("--arch", type=click.Choice(["llama", "qwen2", "qwen3_moe"]), default="llama",
              help="qwen3_moe: a mixture of experts (MOE_KIT: 4 experts, top-2, every layer sparse)")
@click.option("--layers", default=2, show_default=True)
@click.option("--hidden", default=64, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--heads", default=4, show_default=True, help="attention heads (head_dim = hidden / heads; vLLM on CPU "
              "needs head_dim >= 32, e.g. --hidden 128)")
@click.option("--kv_heads", default=2, show_default=True)
@click.option("--tie", is_flag=True, help="tie the LM head to the input embedding (tie_word_embeddings), as most "
              "small Qwen2.5 / Llama-3.2 / SmolLM checkpoints do")
@click.option("--shape", type=click.Choice(["tiny", "real"]), default="tiny", show_default=True,
              help="real: shaped like a small chat checkpoint (32768-entry vocabulary, ChatML template, pad == eos == "
                   "<|im_end|>, tied head, GQA, chat-message data; see the module docstring); the other options "
                   "except --out and --seed then do not apply")
def main(out, arch, layers, hidden, seed, heads, kv_heads, tie, shape):
    if shape == "real":
        make_real(out, seed)
        click.echo(f"wrote the real-shaped qwen2 kit to {out}")
        return
    make_tiny(out, arch, layers, hidden, seed, heads, kv_heads, tie)
    click.echo(f"wrote tiny {arch} kit to {out}")


if __name__ == "__main__":
    main()
