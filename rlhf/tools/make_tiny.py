"""Write an offline tiny kit: causal LM, reward model, tokenizer, task data.

    python -m rlhf.tools.make_tiny --out DIR [--arch llama|qwen2] [--layers 2] [--hidden 64] [--heads 4] [--tie]

DIR            HF causal LM + tokenizer (AutoModelForCausalLM.from_pretrained(DIR))
DIR/reward     HF sequence-classification reward model + tokenizer
DIR/data       prompts_train/eval.jsonl, sft_train/eval.jsonl, pref_train/eval.jsonl
"""
from __future__ import annotations

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
    return (Qwen2Config if arch == "qwen2" else LlamaConfig)(**common)


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
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=parent)
    try:
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
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
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
@click.option("--arch", type=click.Choice(["llama", "qwen2"]), default="llama")
@click.option("--layers", default=2, show_default=True)
@click.option("--hidden", default=64, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--heads", default=4, show_default=True, help="attention heads (head_dim = hidden / heads; vLLM on CPU "
              "needs head_dim >= 32, e.g. --hidden 128)")
@click.option("--kv_heads", default=2, show_default=True)
@click.option("--tie", is_flag=True, help="tie the LM head to the input embedding (tie_word_embeddings), as most "
              "small Qwen2.5 / Llama-3.2 / SmolLM checkpoints do")
def main(out, arch, layers, hidden, seed, heads, kv_heads, tie):
    make_tiny(out, arch, layers, hidden, seed, heads, kv_heads, tie)
    click.echo(f"wrote tiny {arch} kit to {out}")


if __name__ == "__main__":
    main()
