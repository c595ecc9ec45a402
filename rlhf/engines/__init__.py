from rlhf.engines.hf_engine import HFEngine
from rlhf.engines.rollout import Batch, RolloutEngine, SamplingParams, response_mask
