"""vLLM engine inside the torchrun ranks (``distributed_executor_backend="external_launcher"``).

Each TP group of rollout ranks builds one ``vllm.LLM``; all ranks of the group
call ``generate`` with the same prompts (vLLM's SPMD contract) and get the same
outputs.  GPU only; the tests that need it are marked ``gpu``.
"""
from __future__ import annotations

import os
from typing import List, Sequence

import torch

from .base import RolloutBatch, RolloutEngine, SamplingParams

SUPPORTED = ((0, 10, 2), (0, 13, 0))  # [min, max) tested


def check_vllm():
    try:
        import vllm
    except ImportError as e:
        raise RuntimeError("--rollout_engine vllm needs vLLM: pip install 'rlhf[vllm]' (or use --rollout_engine hf)") from e
    ver = tuple(int(x) for x in vllm.__version__.split("+")[0].split(".")[:3] if x.isdigit())
    if not (SUPPORTED[0] <= ver < SUPPORTED[1]):
        raise RuntimeError(f"vLLM {vllm.__version__} is outside the tested range "
                           f"{'.'.join(map(str, SUPPORTED[0]))} <= v < {'.'.join(map(str, SUPPORTED[1]))}")
    return vllm


def _load_weights_on_worker(worker, weights):
    worker.model_runner.model.load_weights(weights=weights)


class VLLMEngine(RolloutEngine):
    def __init__(self, model_path: str, tp_size: int, gpu_memory_utilization: float, enable_sleep: bool,
                 max_model_len: int, seed: int, pad_token_id: int, eos_token_id: int, dtype: str = "bfloat16",
                 enforce_eager: bool = False, sleep_level: int = 1):
        vllm = check_vllm()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.llm = vllm.LLM(model=model_path, tensor_parallel_size=tp_size, distributed_executor_backend="external_launcher",
                            gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep,
                            max_model_len=max_model_len, seed=seed, dtype=dtype, enforce_eager=enforce_eager,
                            enable_prefix_caching=True)
        self.vllm = vllm
        self.pad, self.eos = pad_token_id, eos_token_id
        self.sleep_level = sleep_level
        self.enable_sleep = enable_sleep

    def generate(self, prompt_ids: Sequence[List[int]], params: SamplingParams) -> RolloutBatch:
        sp = self.vllm.SamplingParams(n=params.n, temperature=params.temperature, top_p=params.top_p,
                                      top_k=params.top_k, max_tokens=params.max_new_tokens, logprobs=0,
                                      stop_token_ids=list(params.stop_token_ids) or [self.eos], seed=params.seed)
        prompts = [self.vllm.inputs.TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        outs = self.llm.generate(prompts, sp, use_tqdm=False)
        P = max(len(p) for p in prompt_ids)
        rows = [(o.prompt_token_ids, c) for o in outs for c in o.outputs]
        R = max(1, max(len(c.token_ids) for _, c in rows))
        B = len(rows)
        seqs = torch.full((B, P + R), self.pad, dtype=torch.long)
        att = torch.zeros((B, P + R), dtype=torch.long)
        am = torch.zeros((B, R), dtype=torch.long)
        lp = torch.zeros((B, R), dtype=torch.float32)
        trunc = torch.zeros(B, dtype=torch.bool)
        for i, (p, c) in enumerate(rows):
            seqs[i, P - len(p):P] = torch.tensor(p)
            att[i, P - len(p):P] = 1
            n = len(c.token_ids)
            seqs[i, P:P + n] = torch.tensor(c.token_ids)
            att[i, P:P + n] = 1
            am[i, :n] = 1
            lp[i, :n] = torch.tensor([list(d.values())[0].logprob if d else 0.0 for d in (c.logprobs or [])][:n])
            trunc[i] = c.finish_reason == "length"
        return RolloutBatch(seqs, att, am, lp, P, trunc)

    def load_weights(self, named_tensors) -> None:
        """In-process: with external_launcher and V1 multiprocessing off, collective_rpc runs on this rank's worker,
        so the tensors are handed over without a copy through another process."""
        weights = list(named_tensors)
        if hasattr(self.llm, "collective_rpc"):
            self.llm.collective_rpc(_load_weights_on_worker, args=(weights,))
        else:  # older engines expose the worker directly
            self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.load_weights(weights=weights)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        if self.enable_sleep:
            self.llm.sleep(level=self.sleep_level)

    def wake(self, tags=None) -> None:
        if self.enable_sleep:
            self.llm.wake_up(tags=tags)
