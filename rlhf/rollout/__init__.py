from .base import Batch, RolloutEngine, SamplingParams, response_mask
from .hf_engine import HFEngine
