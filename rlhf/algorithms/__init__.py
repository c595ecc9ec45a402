"""Pure tensor algorithms, registered by name (see registry.py)."""
from rlhf.algorithms import advantages, aggregation, kl, policy_loss, preference, shaping  # noqa: F401  (fill registries)
from rlhf.algorithms.advantages import compute_advantages, gae_advantages, return_to_go
from rlhf.algorithms.aggregation import LossTotals, aggregate, local_totals
from rlhf.algorithms.distill import kd_forward_kl, opd_token_reward, reverse_kl_per_token, topk_forward_kl
from rlhf.algorithms.kl import compute_kl, fold_kl_into_rewards, kl_unbiased_gradient, make_kl_controller
from rlhf.algorithms.logprob import entropy_chunked, logprobs_from_logits
from rlhf.algorithms.masked import masked_mean, masked_whiten
from rlhf.algorithms.policy_loss import IS_LEVEL_MODE_KIND, divergence_gated_weights, entropy_from_logits, importance_weights, value_loss
from rlhf.algorithms.preference import dpo_loss, sft_token_loss
from rlhf.algorithms.registry import (
                       ADVANTAGE_ESTIMATORS,
                       DISTILLATION,
                       IS_CORRECTIONS,
                       IS_GATES,
                       KL_ESTIMATORS,
                       LOSS_AGGREGATIONS,
                       POLICY_LOSSES,
                       PREFERENCE_LOSSES,
                       REWARD_MODEL_LOSSES,
)
from rlhf.algorithms.shaping import (
                       RunningMeanStd,
                       clip_rewards,
                       dynamic_filter_mask,
                       dynamic_filter_refill,
                       dynamic_filter_select,
                       overlong_penalty,
                       stop_properly_penalty,
)
