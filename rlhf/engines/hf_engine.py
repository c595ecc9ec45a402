"""HF rollout engine (a KV-cached decode loop over a transformers model): CPU / test / debug, vLLM's contract."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from rlhf.batch import Batch, cat
from rlhf.data.formatting import pad_batch
from rlhf.distributed.lora_sync import AdapterVersions, _engine_name
from rlhf.distributed.weight_sync import tied_aliases
from rlhf.engines.hf_continuous import ContinuousDecoder, continuous_cache_ok
from rlhf.engines.requests import StepResult, run_whole
from rlhf.engines.rollout import RolloutEngine, SamplingParams, response_mask
from rlhf.engines.rollout_registry import EngineArgs
from rlhf.engines.sampling import decode_with_head, logits_head
from rlhf.models import moe
from rlhf.models.load import load_causal_lm, load_tokenizer
from rlhf.models.vision import cut_at_tokens, gather_images, vision_forward_kwargs, vision_token_ids


def stop_ids(requested: Sequence[int], eos_id, generation_config=None) -> tuple:
    """The token ids that end a response, as vLLM stops (vllm/sampling_params.py ``update_from_generation_config``):
    the requested ``stop_token_ids``, the tokenizer's eos, and every ``eos_token_id`` of the model's
    generation_config.json (an int or a list: chat checkpoints list the end-of-turn token and the end-of-text one,
    e.g. Qwen2.5-Instruct ``[<|im_end|>, <|endoftext|>]``).  Sorted, each once."""
    ids = set(int(t) for t in requested)
    if eos_id is not None:
        ids.add(int(eos_id))
    gen = getattr(generation_config, "eos_token_id", None)
    if gen is not None:
        ids.update(int(t) for t in ([gen] if isinstance(gen, int) else gen))
    return tuple(sorted(ids))


class HFEngine(RolloutEngine):
    """Holds its own copy of the policy (like a vLLM engine would); weights arrive via load_weights."""

    def __init__(self, model: torch.nn.Module, tokenizer, device=None, micro_batch_size: int = 16,
                 max_model_len: Optional[int] = None, lora_adapters: bool = False):
        """``lora_adapters`` (--lora_rank with --lora_sync adapter): the model becomes a peft model at the first
        ``load_adapter``; each adapter version is a named peft adapter, the newest active."""
        self.model = model.to(device or torch.device("cpu"))
        # prompt + response tokens of one sample, as vLLM's max_model_len (a generation stops there, finish reason
        # "length"): RL's --max_len (OpenRLHF's prompt + response budget); None: --generate_max_len alone
        self.max_model_len = max_model_len
        self.model.eval()
        self.model.requires_grad_(False)
        self.tokenizer = tokenizer
        self.device = device or torch.device("cpu")
        self.micro_batch_size = micro_batch_size
        self._offloaded = False
        self.decoder: Optional[ContinuousDecoder] = None  # the running batch of step_requests, built at its first
        self._continuous = continuous_cache_ok(self.model)
        self._routes = False  # record_routing
        self._lora, self._versions = lora_adapters, AdapterVersions()

    def _stop_ids(self, params: SamplingParams) -> tuple:
        return stop_ids(params.stop_token_ids, self.tokenizer.eos_token_id, getattr(self.model, "generation_config", None))

    def _idle(self, what: str) -> None:
        if self.decoder is not None and self.decoder.busy:
            raise RuntimeError(f"HFEngine.{what} while {len(self.decoder.rows)} per-request generations run "
                               f"(step_requests): finish or abort them first (an episode is never cut at a weight "
                               f"sync)")

    @torch.no_grad()
    def step_requests(self, admit, abort=()) -> StepResult:
        """One step of the running batch (``hf_continuous.ContinuousDecoder``: at most micro_batch_size rows
        decode together, as ``generate`` decodes in chunks of that many rows); a model whose cache is not
        full-attention, or a vision-language model, runs each admitted request whole (``requests.run_whole``)."""
        if not self._continuous:
            return run_whole(self, admit)
        if any(r.images is not None for r in admit) or vision_token_ids(getattr(self.model, "config", None)):
            return run_whole(self, admit)  # a VLM: generate's path (an image prompt's prefill needs pixel_values
            # and mrope positions, which the running batch does not compute; a sampled placeholder is cut there)
        if self.decoder is None:
            self.decoder = ContinuousDecoder(self.model, self.device, self.tokenizer.pad_token_id, self._stop_ids,
                                             self.max_model_len, max_rows=self.micro_batch_size)
        return self.decoder.step(admit, abort)

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[List[int]], params: SamplingParams, images=None) -> Batch:
        self._idle("generate")
        stop = self._stop_ids(params)
        per = max(1, self.micro_batch_size // max(params.n, 1))
        outs = []
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        with logits_head(self.model) as head:  # one head copy for every chunk of this call
            for s in range(0, len(prompt_ids), per):
                outs.append(self._generate_chunk(prompt_ids[s:s + per], params, stop, gen, head,
                                                 images[s:s + per] if images else None))
        out = cat(outs, self.tokenizer.pad_token_id)
        if self._routes:
            out.routed_experts = self._routing(out)
        return out

    def record_routing(self) -> bool:
        """Its MoE routers' choices ride in ``routed_experts`` (a dense model: False)."""
        self._routes = bool(moe.routers(self.model))
        return self._routes

    def set_experts_implementation(self, implementation: str) -> None:
        moe.set_experts(self.model, implementation)

    def _routing(self, b: Batch) -> torch.Tensor:
        """(B, P + R, L * k): the experts the engine's routers pick for every token of the finished rows, from one
        no-grad forward of the engine's own model (its weights and dtype) over them, -1 on padding; the decode loop
        saw the same tokens one at a time (same choices up to kernel rounding at exact near-ties)."""
        ids, att = b.sequences.to(self.device), b.attention_mask.to(self.device)
        with moe.Routing(self.model, record=True) as r:
            self.model(input_ids=ids, attention_mask=att, position_ids=(att.long().cumsum(-1) - 1).clamp(min=0),
                       use_cache=False, logits_to_keep=1)
        return r.used.view(*ids.shape, -1).masked_fill(~att.bool().unsqueeze(-1), moe.NO_ROUTE).cpu()

    def _generate_chunk(self, prompts, params: SamplingParams, stop, gen, head, images=None) -> Batch:
        pad = self.tokenizer.pad_token_id
        ids, att = pad_batch(prompts, pad, side="left")
        ids, att = ids.to(self.device), att.to(self.device)
        prefill = vision_forward_kwargs(self.model, gather_images([i and i[0] for i in images], [i and i[1] for i in
                                                                   images], slice(None), self.device), ids, att) \
            if images else None
        steps, room = params.max_new_tokens, None
        if self.max_model_len:  # each row may take what its prompt leaves of max_model_len (at least 1 token)
            room = (self.max_model_len - att.sum(1)).clamp(min=1).repeat_interleave(params.n)
            steps = max(1, min(steps, int(room.max())))
        resp, lp = decode_with_head(self.model, head, ids, att, params.n, steps, stop, pad,
                                    temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                    generator=gen, prefill=prefill)
        ids, att = ids.repeat_interleave(params.n, 0), att.repeat_interleave(params.n, 0)
        am = response_mask(resp, stop)
        is_stop = torch.isin(resp, torch.tensor(stop, device=resp.device))
        if room is not None:  # past a row's room: as if its generation had ended there (vLLM: finish reason length)
            cut = torch.arange(resp.size(1), device=resp.device).unsqueeze(0) >= room.to(resp.device).unsqueeze(1)
            am, is_stop, resp = am * ~cut, is_stop & ~cut, resp.masked_fill(cut, pad)
        truncated = ~is_stop.any(1)
        seqs = torch.cat([ids, resp], 1)
        full_att = torch.cat([att, am], 1)
        out = Batch(sequences=seqs.cpu(), attention_mask=full_att.cpu(), action_mask=am.cpu(),
                    rollout_logprobs=(lp * am).cpu(), prompt_len=ids.size(1), truncated=truncated.cpu())
        return cut_at_tokens(out, vision_token_ids(getattr(self.model, "config", None)), pad)  # a VLM's placeholders

    def load_weights(self, named_tensors) -> None:
        self._idle("load_weights")
        params = {_engine_name(n): p for n, p in self.model.named_parameters()}  # a peft model's base under plain names
        for name, t in named_tensors:
            if name not in params:
                raise KeyError(f"rollout engine has no parameter {name!r} (actor and engine models differ)")
            params[name].data.copy_(t.to(params[name].dtype))

    @property
    def lora_adapters(self) -> bool:
        return self._lora

    def load_adapter(self, version: int, named_tensors, config: dict, keep: int = 1) -> None:
        """peft: adapter ``v<version>`` added (``add_adapter`` / ``get_peft_model`` the first time), filled from the
        saved names (``set_peft_model_state_dict``), made the active one; versions past the newest ``keep`` are
        deleted.  No merge: the forward is W x + s B A x, as the trainer's."""
        import peft

        name, cfg = f"v{version}", peft.LoraConfig(**config)
        if version in self._versions.held:
            self.model.delete_adapter(name)
        if isinstance(self.model, peft.PeftModel):
            self.model.add_adapter(name, cfg)
        else:
            self.model = peft.get_peft_model(self.model, cfg, adapter_name=name)
        state = {n: t.to(self.device) for n, t in named_tensors}
        res = peft.set_peft_model_state_dict(self.model, state, adapter_name=name)
        missing = [k for k in res.missing_keys if f".{name}." in k and "lora_" in k]
        if missing:
            raise KeyError(f"adapter version {version} lacks {missing[:3]} (actor and engine models differ)")
        self._versions.keep = max(1, keep)
        for old in self._versions.add(version):
            self.model.delete_adapter(f"v{old}")
        self.model.set_adapter(name)
        self.model.eval()
        self.model.requires_grad_(False)

    def reset_prefix_cache(self) -> None:
        return None  # the decode loop keeps no cache across calls

    def shared_weight_names(self) -> set:
        """Tied weights (``lm_head.weight`` is ``embed_tokens.weight``): the model shares the tensor, loading the
        first name sets both."""
        return {n for names in tied_aliases(self.model).values() for n in names}

    def sleep(self) -> None:
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._offloaded = True

    def wake(self, tags=None) -> None:
        if self.device.type != "cpu" and self._offloaded:
            self.model.to(self.device)
        self._offloaded = False

    def memory_state(self) -> str:
        """``full`` | ``asleep`` (no partial state: the model moves as one)."""
        return "asleep" if self._offloaded else "full"


def build_hf_engine(args: EngineArgs) -> HFEngine:
    """The registry's ``hf`` engine: the policy loaded for generation only (bf16 under --bf16)."""
    model = load_causal_lm(args.model_path, args.bf16, trainable=False)
    model.config.use_cache = True
    return HFEngine(model, load_tokenizer(args.model_path), args.device, micro_batch_size=args.micro_batch_size,
                    max_model_len=args.max_model_len, lora_adapters=args.lora_rank > 0)
