"""Pure tensor algorithms, registered by name (see registry.py)."""
from . import advantages, aggregation, kl, policy_loss, preference, shaping  # noqa: F401  (fill registries)
from .advantages import compute_advantages, gae_advantages, return_to_go
from .aggregation import LossTotals, aggregate, local_totals
from .kl import compute_kl, fold_kl_into_rewards, kl_unbiased_gradient, make_kl_controller
from .logprob import entropy_chunked, logprobs_from_logits
from .masked import masked_mean, masked_whiten
from .policy_loss import IS_LEVEL_MODE_KIND, divergence_gated_weights, entropy_from_logits, importance_weights, value_loss
from .preference import dpo_loss, sft_token_loss
from .registry import (
                       ADVANTAGE_ESTIMATORS,
                       IS_CORRECTIONS,
                       IS_GATES,
                       KL_ESTIMATORS,
                       LOSS_AGGREGATIONS,
                       POLICY_LOSSES,
                       PREFERENCE_LOSSES,
                       REWARD_MODEL_LOSSES,
)
from .shaping import (
                       RunningMeanStd,
                       clip_rewards,
                       dynamic_filter_mask,
                       dynamic_filter_refill,
                       dynamic_filter_select,
                       overlong_penalty,
                       stop_properly_penalty,
)
