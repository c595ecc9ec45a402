"""The data flags settled at parse time, before any process group, with OpenRLHF's meaning.

* ``--eval_split`` names the split of ``--eval_dataset`` (OpenRLHF openrlhf/cli/train_*.py: ``--eval_split``,
  default "train"). The random hold-out of training rows it named here before is ``--eval_holdout`` (default 0:
  OpenRLHF trains on every row and evaluates only with ``--eval_dataset``); a number given to ``--eval_split`` is
  read as ``--eval_holdout`` with a notice that names the new flag.
* ``--input_template`` without ``{}`` is dropped, and a literal ``\\n`` in it is warned about, as OpenRLHF's
  CLIs do (openrlhf/cli/train_sft.py after ``hierarchize``).
* ``--label_key`` defaults to None (OpenRLHF openrlhf/cli/train_ppo_ray.py ``--label_key`` default None: the
  reward gets no labels); the built-in arithmetic reward (``--remote_rm_url builtin:arithmetic``, or no reward
  given) reads its own task's ``label`` column, so it takes ``label`` when the flag is not given.
"""
from __future__ import annotations

import sys

from rlhf.console import print0

BUILTIN_LABEL_KEY = "label"


def _number(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def settle_eval_split(d, error) -> None:
    """A number in ``--eval_split`` (its meaning here before) -> ``--eval_holdout``; the hold-out in [0, 1)."""
    frac = _number(d.eval_split)
    if frac is not None:
        if d.eval_holdout:
            raise error("eval_split", f"--eval_split {d.eval_split} and --eval_holdout {d.eval_holdout}: --eval_split "
                                      f"names the split of --eval_dataset (OpenRLHF's meaning); give the hold-out "
                                      f"fraction once, as --eval_holdout")
        if frac:  # 0 is the default now: nothing changes, nothing to say
            print0(f"[config] --eval_split {d.eval_split}: a number is read as --eval_holdout {frac:g} (the fraction "
                   f"of training rows held out for eval); --eval_split now names the split of --eval_dataset, as in "
                   f"OpenRLHF", file=sys.stderr)
        d.eval_holdout, d.eval_split = frac, "train"
    if not 0.0 <= d.eval_holdout < 1.0:
        raise error("eval_holdout", f"--eval_holdout must lie in [0, 1), got {d.eval_holdout}; e.g. --eval_holdout "
                                    f"0.1, or --eval_dataset FILE to evaluate on other data")


def settle_input_template(d) -> None:
    """OpenRLHF: a template without ``{}`` is set to None (with a warning); a literal backslash-n is warned about."""
    t = d.input_template
    if t and "{}" not in t:
        print0(f"[config] --input_template {t!r} has no '{{}}' for the input: it is not used (as OpenRLHF: set to "
               f"None)", file=sys.stderr)
        d.input_template = None
    elif t and "\\n" in t:
        print0("[config] --input_template contains the two characters \\n instead of a newline; you likely want "
               "$'...\\n...' in Bash (OpenRLHF warns the same)", file=sys.stderr)


def uses_builtin_reward(rollout, reward_pretrain) -> bool:
    """Whether the reward is the built-in arithmetic one: ``rollout`` (the --rollout flag group,
    rlhf.config.schema.RolloutConfig) names ``--remote_rm_url builtin:arithmetic``, or gives no reward (no URL, no
    --agent_func_path) and there is no --reward_pretrain."""
    url = (rollout.remote_rm_url or "").strip()
    return url == "builtin:arithmetic" or (not url and not reward_pretrain and not rollout.agent_func_path)


def settle_label_key(d, builtin_reward: bool) -> None:
    """``--label_key ""`` is None (no labels); unset with the built-in arithmetic reward: its ``label`` column."""
    if d.label_key is None and builtin_reward:
        d.label_key = BUILTIN_LABEL_KEY
    elif not d.label_key:
        d.label_key = None


def settle_data_flags(d, kind: str, error, builtin_reward: bool) -> None:
    """Every data flag above, on ``d`` (the --data flag group, rlhf.config.schema.DataConfig); ``error(flag,
    message)`` builds the ConfigError; ``builtin_reward`` is ``uses_builtin_reward`` (RL's --label_key default)."""
    settle_eval_split(d, error)
    settle_input_template(d)
    if kind in ("ppo", "grpo"):
        settle_label_key(d, builtin_reward)
