from rlhf.models.critic import CriticModel
from rlhf.models.forward import action_logprobs, packed_action_logprobs
from rlhf.models.load import load_causal_lm, load_reward_model, load_tokenizer, resolve_pretrain
