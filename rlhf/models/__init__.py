from .critic import CriticModel
from .forward import action_logprobs, packed_action_logprobs
from .load import load_causal_lm, load_reward_model, load_tokenizer, resolve_pretrain
