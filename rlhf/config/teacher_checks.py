"""The teacher's checks before any process group (rlhf/config/preflight.py): distillation compares the student's
and the teacher's probabilities of the same token ids, so the tokenizers must be one vocabulary (OpenRLHF PR #1276
openrlhf/cli/train_opd.py refuses ``student_vocab != teacher_vocab``, a different eos / pad id or
``config.vocab_size``), and the flags must name a mode that exists."""
from __future__ import annotations

from typing import Optional

from rlhf.errors import ConfigError

RL_KINDS = ("ppo", "grpo")


def vocab_difference(student, teacher) -> Optional[str]:
    """None when the two tokenizers are one vocabulary (same size, same token -> id map, same eos / pad ids),
    else a sentence naming both sizes and a token that differs."""
    sv, tv = student.get_vocab(), teacher.get_vocab()
    sizes = f"the student's has {len(sv)} tokens, the teacher's {len(tv)}"
    if sv != tv:
        s_by_id, t_by_id = {i: t for t, i in sv.items()}, {i: t for t, i in tv.items()}
        diff = next((i for i in sorted(set(s_by_id) | set(t_by_id)) if s_by_id.get(i) != t_by_id.get(i)), None)
        return (f"{sizes}; token id {diff} is {s_by_id.get(diff)!r} in the student's and {t_by_id.get(diff)!r} in "
                f"the teacher's")
    for name in ("eos_token_id", "pad_token_id"):
        if getattr(student, name) != getattr(teacher, name):
            return f"{sizes}; {name} is {getattr(student, name)} in the student's, {getattr(teacher, name)} in the teacher's"
    return None


def check_teacher(cfg, kind: str) -> None:
    """Refuse (ConfigError naming the flag and a value that works) a teacher whose tokenizer or LM-head size differs
    from --pretrain's, --teacher_url outside RL, an --opd_topk that cannot run (``check_topk``), --kd_coef outside
    [0, 1]."""
    t = cfg.teacher
    if not (t.teacher_pretrain or t.teacher_url):
        return
    if t.teacher_url and kind not in RL_KINDS:
        raise ConfigError("teacher_url", f"--teacher_url serves on-policy distillation (rlhf.train_grpo / "
                                         f"train_ppo); {kind} distills from a local --teacher_pretrain DIR")
    if t.teacher_url and cfg.rollout.temperature not in (0.0, 1.0):
        raise ConfigError("teacher_url", f"--teacher_url gives log-probs at temperature 1 (vLLM computes prompt "
                                         f"log-probs from the raw logits) and the student's are at --temperature "
                                         f"{cfg.rollout.temperature}: give --temperature 1.0, or a local "
                                         f"--teacher_pretrain (scored at the rollout's temperature)")
    if t.opd_topk != 0:
        check_topk(cfg, kind)
    if kind == "sft" and cfg.topology.ring_attn_size > 1:
        raise ConfigError("ring_attn_size", f"--teacher_pretrain in SFT compares full-vocabulary distributions on "
                                            f"whole rows: give --ring_attn_size 1 (got {cfg.topology.ring_attn_size})")
    if not 0.0 <= t.kd_coef <= 1.0:
        raise ConfigError("kd_coef", f"--kd_coef {t.kd_coef} must lie in [0, 1] (loss = (1 - a) CE + a KL), e.g. 0.5")
    if not t.teacher_pretrain:
        return
    from rlhf.models.load import load_tokenizer, resolve_pretrain
    from rlhf.planning.dims import dims_of

    student = resolve_pretrain(cfg.model.pretrain)
    why = vocab_difference(load_tokenizer(student), load_tokenizer(t.teacher_pretrain))
    if why is None:
        sv, tv = dims_of(student).vocab, dims_of(t.teacher_pretrain).vocab
        why = None if sv == tv else f"the student's LM head has {sv} rows (config vocab_size), the teacher's {tv}"
    if why:
        raise ConfigError("teacher_pretrain", f"--teacher_pretrain {t.teacher_pretrain} does not share the "
                                              f"student's vocabulary (--pretrain {student}): {why}. Distillation "
                                              f"compares log-probs of the same token ids: give a teacher with the "
                                              f"student's tokenizer (e.g. an SFT of --pretrain)")


def check_topk(cfg, kind: str) -> None:
    """--opd_topk k > 0 (the top-k forward-KL loss term, rlhf.algorithms.distill ``topk_forward_kl_at``): RL with a
    local teacher (its forward records the top k), a vocabulary the head holds whole and rows not split."""
    t, why = cfg.teacher, None
    if t.opd_topk < 0:
        why = "k must be >= 0"
    elif kind not in RL_KINDS:
        why = f"the top-k term is on-policy distillation (rlhf.train_grpo / train_ppo); {kind} uses --kd_coef"
    elif t.teacher_url:
        why = ("--teacher_url returns the sampled tokens' prompt log-probs only; the top-k term needs the "
               "teacher's top-k at every position: give a local --teacher_pretrain DIR")
    elif cfg.parallel.tp_size > 1:
        why = f"--tp_size {cfg.parallel.tp_size} shards the LM head's vocabulary: give --tp_size 1"
    elif cfg.topology.ring_attn_size > 1:
        why = f"--ring_attn_size {cfg.topology.ring_attn_size} splits the rows: give --ring_attn_size 1"
    if why:
        raise ConfigError("opd_topk", f"--opd_topk {t.opd_topk}: {why} (or --opd_topk 0, the sampled-token "
                                      f"reverse KL alone)")
