from .base import RolloutBatch, RolloutEngine, SamplingParams, merge_batches, response_mask
from .hf_engine import HFEngine
