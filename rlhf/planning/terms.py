"""Device-memory terms of one rank, one pure function per term, in bytes.  Notation used in every docstring:

    N   parameters of the model          dp  ranks the model is sharded over (its role's group)
    c   bytes of the compute dtype       (2 under --bf16, else 4)
    h, q, kv, i   hidden size, heads x head_dim, kv_heads x head_dim, MLP intermediate size
    L   decoder layers     V  vocabulary     b  sequences in a micro-batch     s  tokens per sequence

Sources.  Model states: DeepSpeed's estimators (deepspeed/runtime/zero/stage3.py
``estimate_zero3_model_states_mem_needs``: 18 bytes/param over the ranks + 4 x the largest layer;
stage_1_and_2.py ``estimate_zero2_model_states_mem_needs``: 2 bytes/param whole + 18 over the ranks), and for FSDP2
our own engine (rlhf/engines/fsdp2.py: fp32 sharded masters, gradients and AdamW state; bf16 all-gathered copies
per unit).  Activations: the per-layer accounting of Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models" (sbh(34 + 5as/h) bytes for a GPT layer at 16 bits: every tensor autograd saves, the
s^2 term being the attention scores), redone for a Llama/Qwen2 block as transformers runs it (RMSNorm in fp32,
rotary, SwiGLU, GQA, no dropout); flash / memory-efficient attention keep no s^2 scores (Korthikanti's "selective
recomputation" saving, obtained by the kernel), only a log-sum-exp per row.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

from rlhf.planning.dims import ModelDims

GiB = 1 << 30


@dataclass
class States:
    """One model's resident bytes on a rank (device) and what it keeps on the host."""
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    gathered: float = 0.0      # unsharded compute copies alive during forward/backward (FSDP2 units, ZeRO-3 layers)
    host: float = 0.0          # optimizer / params offloaded to CPU memory (--adam_offload)
    parts: Dict[str, float] = field(default_factory=dict)

    @property
    def resident(self) -> float:
        """Held between stages (what sleep offloads)."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.resident + self.gathered


def stored_bytes(c: int, trainable: bool, lora: bool = False) -> int:
    """Bytes per parameter a model is stored in (rlhf/models/load.py ``weight_dtype``): a trainable model keeps
    fp32 masters whatever --bf16 says; a frozen one (reference, reward model) is stored in the compute dtype
    (bf16 under --bf16, veRL's choice too), and so is a LoRA model's frozen base (``lora``; its adapters: fp32)."""
    return 4 if trainable and not lora else c


def fsdp2_states(n: int, dp: int, c: int, zero_stage: int, trainable: bool, layer_params: int, root_params: int,
                 adam_offload: bool = False, no_sync: bool = False, adapters: int = 0) -> States:
    """FSDP2 (rlhf/engines/fsdp2.py): parameters stored sharded, fp32 when trainable (frozen: c, ``stored_bytes``),

        params    = 4 N / dp           (frozen: c N / dp)
        grads     = 4 N / dp           (trainable; --grad_accum_no_sync: 4 N, full unsharded fp32 gradients)
        optimizer = 8 N / dp           (AdamW exp_avg + exp_avg_sq, fp32; --adam_offload: on the host instead,
                                        with the fp32 params and grads: FSDP2 CPUOffloadPolicy)
        gathered  = c (root + 2 x layer)   --zero_stage 3 (reshard after forward: the unit computing and the one
                                           prefetched; the root unit stays unsharded from forward to backward)
                  = c N                    --zero_stage < 3 (every unit stays unsharded until backward is done)

    A model on one rank without --bf16 (and without --adam_offload) is a plain module (no gathered copy).

    ``adapters`` (A > 0, --lora_rank): the N base weights are frozen, stored in c (bf16 under --bf16,
    rlhf/models/load.py ``weight_dtype(..., lora=True)``), and only the A adapter weights are fp32 masters with
    gradients and AdamW state (``apply_lora`` keeps them fp32): params = c N / dp + 4 A / dp, grads 4 A / dp,
    optimizer 8 A / dp; --adam_offload puts the whole model's shards on the host (CPUOffloadPolicy)."""
    if adapters and trainable:
        base = fsdp2_states(n, dp, c, zero_stage, False, layer_params, root_params)
        ad = fsdp2_states(adapters, dp, c, zero_stage, True, 0, 0, False, no_sync)
        st = States(params=base.params + ad.params, grads=ad.grads, optimizer=ad.optimizer,
                    gathered=base.gathered + ad.gathered)
        if adam_offload:
            st.host = st.params + st.grads + st.optimizer
            st.params = st.grads = st.optimizer = 0.0
        return st
    st = States()
    sharded = dp > 1 or c < 4 or (adam_offload and trainable)  # offload shards one rank too (a single shard)
    st.params = float(stored_bytes(c, trainable)) * n / dp
    if trainable:
        st.grads = 4.0 * n if no_sync else 4.0 * n / dp
        st.optimizer = 8.0 * n / dp
        if adam_offload:
            st.host = st.params + st.grads + st.optimizer
            st.params = st.grads = st.optimizer = 0.0
    if sharded:
        st.gathered = c * (root_params + 2 * layer_params) if zero_stage >= 3 else float(c * n)
    return st


def ep_states(job, rm, shard: int) -> States:
    """An MoE actor / reference under --ep_size (rlhf.distributed.expert_parallel): the dense weights as FSDP2
    shards them (``fsdp2_states`` over ``shard`` ranks, units without experts), plus this rank's experts, which
    FSDP2 leaves whole (never gathered; replicated over the dp/ep ranks that share its ep coordinate):

        X = L E 3 h i_e;  params += s X / ep,  grads += 4 X / ep,  optimizer += 8 X / ep   (s: stored bytes)"""
    d = rm.dims
    x = d.layers * d.layer_expert_params
    st = fsdp2_states(rm.n - x, shard, job.c, job.zero_stage, rm.trainable, d.layer_params - d.layer_expert_params,
                      d.root_params, False, job.grad_accum_no_sync and rm.trainable)
    mine = float(x) / max(1, job.ep_size)
    st.params += stored_bytes(job.c, rm.trainable) * mine
    if rm.trainable:
        st.grads += 4.0 * mine
        st.optimizer += 8.0 * mine
    return st


def deepspeed_states(n: int, dp: int, bf16: bool, zero_stage: int, trainable: bool, layer_params: int,
                     adam_offload: bool = False, adapters: int = 0) -> States:
    """DeepSpeed ZeRO, bytes per parameter as DeepSpeed's own estimators count them (module docstring):

        params    = c N          / dp at stage 3
        grads     = c N          / dp at stage >= 2   (--bf16 stage 3: 0, reduced straight into the fp32 partition)
        optimizer = (16 | 8) N   / dp at stage >= 1   (--bf16: fp32 master 4 + fp32 grads 4 + Adam 8; else Adam 8)
        gathered  = 4 x one layer at stage 3 (DeepSpeed's ``largest_layer_memory``)

    so --bf16 stage 3 is 18 N / dp and stage 2 is 2 N + 18 N / dp, DeepSpeed's own numbers.  --adam_offload
    (``offload_optimizer``): the optimizer term on the host.  Frozen (ref, reward; ``freeze_plain`` or ZeRO-3
    eval config): c N, / dp at stage 3.  ``adapters`` (--lora_rank): the base counted frozen, the A adapter weights
    trainable."""
    if adapters and trainable:  # --lora_rank: a frozen base plus trainable adapters
        base = deepspeed_states(n, dp, bf16, zero_stage, False, layer_params)
        ad = deepspeed_states(adapters, dp, bf16, zero_stage, True, 0, adam_offload)
        return States(params=base.params + ad.params, grads=ad.grads, optimizer=ad.optimizer,
                      gathered=base.gathered, host=ad.host)
    st = States()
    c = 2 if bf16 else 4
    st.params = c * n / (dp if zero_stage >= 3 else 1)
    st.gathered = 4.0 * layer_params if zero_stage >= 3 else 0.0
    if not trainable:
        return st
    st.grads = 0.0 if (bf16 and zero_stage >= 3) else c * n / (dp if zero_stage >= 2 else 1)
    opt = (16.0 if bf16 else 8.0) * n / (dp if zero_stage >= 1 else 1)
    if adam_offload:
        st.host = opt
    else:
        st.optimizer = opt
    return st


def layer_activation_bytes(d: ModelDims, tokens: int, c: int, attn: str = "sdpa", seq: int = 0,
                           repeat_kv: bool = True, tp: int = 1) -> float:
    """Bytes autograd saves in one Llama/Qwen2 decoder block for ``tokens`` tokens (b x s), no checkpointing.

    Per token (transformers' LlamaDecoderLayer / Qwen2DecoderLayer; every tensor counted once):

        2 RMSNorms     2 (4 + 2c) h      fp32 copy of the input, normalised x before the weight, the output
        q, k, v        c (q + 2 kv')     after rotary (the projections' outputs are not kept); kv' = q when the
                                         sdpa path repeats k/v to every head (GQA with a padding mask), else kv
        attention out  2 c q + 4 a       sdpa's output and its transposed contiguous copy (o_proj's input),
                                         fp32 log-sum-exp per head (flash_attention_2: c q, no copy)
        eager scores   a s (4 + c)       fp32 softmax and its cast (only attn="eager": the s^2 term)
        SwiGLU MLP     4 c i             gate, up, silu(gate), silu(gate) * up

    For a GPT block at 16 bits Korthikanti et al. count 34 h + 5 a s (eq. 1); this block's SwiGLU (i ~ 2.7-3.5 h)
    and fp32 norms make it 22 h + 4 kv + 8 i at bf16 with flash attention.  --tp_size ``tp``: every term but
    the norms' (replicated hidden states) is a rank's heads / intermediate columns, / tp."""
    h, q, a, i = d.hidden, d.q_dim, d.heads, d.intermediate
    kv = q if (repeat_kv and attn == "sdpa" and d.kv_heads < d.heads) else d.kv_dim
    per = c * (q + 2 * kv) + c * i * 4
    per += (c * q + 4 * a) if attn == "flash" else (2 * c * q + 4 * a)
    if attn == "eager":
        per += a * seq * (4 + c)
    return (per / max(1, tp) + 2 * (4 + 2 * c) * h) * tokens


def mask_bytes(b: int, s: int, attn: str, c: int, layers_saved: int = 1) -> float:
    """The attention mask of a padded batch (0 with flash_attention_2: unpadded varlen, no mask).

    sdpa: transformers builds one bool (b, 1, s, s) mask per forward (b s^2 bytes) and torch's
    ``scaled_dot_product_attention`` converts a bool mask to an additive one of the query's dtype in every layer
    (aten/src/ATen/native/transformers/attention.cpp ``convert_boolean_attn_mask``), which the memory-efficient
    (CUDA) and flash (CPU) kernels keep for backward: + ``layers_saved`` x c b s^2 (training: one per layer, or
    one with checkpointing; no graph: one at a time).  eager: one additive float mask, c b s^2."""
    if attn == "flash":
        return 0.0
    if attn == "eager":
        return float(b * s * s * c)
    return float(b * s * s * (1 + c * max(1, layers_saved)))


def activation_bytes(d: ModelDims, b: int, s: int, c: int, attn: str = "sdpa", checkpointing: bool = False,
                     sp: int = 1, tp: int = 1) -> float:
    """Activations a training forward keeps for backward, one micro-batch of b sequences x s tokens, with
    sequence parallelism over ``sp`` ranks (--ring_attn_size: each rank holds s / sp tokens of every layer):

        no checkpointing   L x layer(b s / sp) + final norm (4 + 2c) h b s / sp + mask (L layers' copies)
        checkpointing      L x c h b s / sp (each block's input)  + one block recomputed in backward
                           layer(b s / sp) + final norm + mask (one layer's copy)"""
    t = -(-b * s // sp)
    layer = layer_activation_bytes(d, t, c, attn, s, tp=tp)
    final = (4 + 2 * c) * d.hidden * t
    m = mask_bytes(b, s, attn, c, 1 if checkpointing else d.layers) / sp
    if checkpointing:
        return d.layers * c * d.hidden * t + layer + final + m
    return d.layers * layer + final + m


def inference_activation_bytes(d: ModelDims, b: int, s: int, c: int, attn: str = "sdpa", sp: int = 1,
                               tp: int = 1) -> float:
    """Peak of a no-grad forward (ref, old log-probs, values, reward): nothing is kept across layers, so the
    peak is one block's working set, taken at the MLP: the residual stream, the normed input (c h each),
    the fp32 norm copy (4 h), gate, up and silu(gate) (3 c i), plus the mask (one layer's converted copy):

        b s / sp x (2 c h + 4 h + 3 c i / tp) + mask      (--tp_size: a rank's intermediate columns)"""
    t = -(-b * s // sp)
    return float(t * (2 * c * d.hidden + 4 * d.hidden + 3 * c * d.intermediate / max(1, tp))) + \
        mask_bytes(b, s, attn, c) / sp


def lm_head_bytes(rows: int, vocab: int, c: int, chunk_rows: int, keep_bytes: int, grad: bool,
                  fused: bool = True) -> float:
    """The LM head's log-prob buffers for ``rows`` response tokens (rlhf/models/lm_head.py).

    fused (default): chunks of ``chunk_rows`` rows (--logprob_chunk_size) run one at a time; with a graph,
    forward keeps exp(z - max) of whole chunks within ``keep_bytes`` (--lm_head_keep_mb) for backward:

        kept  = min(rows, floor(keep_bytes / 4V / chunk) chunk) x 4 V           (grad only)
        chunk = min(rows, chunk_rows) x V x (c + 4 + 4)   the head matmul's output, its fp32 copy (c < 4), the exp

    not fused: the (rows, V) logits in c, their fp32 log-softmax and, with a graph, their gradient:
    rows x V x (c + 4 + 4 [grad])."""
    v = vocab
    if not fused:
        return float(rows * v * (c + 4 + (4 if grad else 0)))
    ch = max(1, min(rows, chunk_rows))
    kept = 0
    if grad and keep_bytes > 0:
        kr = min(rows, keep_bytes // (4 * v))
        kr = kr if kr == rows else kr // ch * ch
        kept = kr * 4 * v
    return float(kept + ch * v * (c + (4 if c < 4 else 0) + 4))


def root_grad_bytes(d: ModelDims, c: int, sharded: bool, lm: bool = True) -> float:
    """Gradient buffers of the root unit (embedding, final norm, head) beside the persistent gradients at the end of
    backward: a tied head's weight gets two fp32 V h gradients (the fused head's and the embedding's dense one)
    before they are summed, + 4 V h; an FSDP2-sharded root holds its unsharded gradient in the compute dtype and
    the fp32 copy it reduce-scatters, + (c + 4) x root params (a value model's root: embedding, norm, value head)."""
    out = 4.0 * d.vocab * d.hidden if (d.tied and lm) else 0.0
    if sharded:
        out += (c + 4.0) * (d.root_params if lm else d.embed_params + 2 * d.hidden)
    return out


def largest_tensor(d: ModelDims) -> int:
    """Elements of the model's largest weight: the embedding / head (V h) or an MLP projection (h i)."""
    return max(d.vocab * d.hidden, d.hidden * d.intermediate, d.hidden * d.q_dim)


def load_transient_bytes(d: ModelDims, stored: int) -> float:
    """What loading adds on every rank of an FSDP2 role beyond its shards (rlhf/engines/fsdp2.py
    ``fill_from_first``): the source rank keeps the full model on the host (detached ``host_copies``, which
    ``fully_shard``'s move of ``.data`` does not touch) and moves one full tensor at a time to the device; every
    member receives that tensor into a device buffer of the same size and keeps its own shard:

        stored x largest tensor   (``stored_bytes``: 4 for a trainable model, c for a frozen one)"""
    return float(stored * largest_tensor(d))


def sync_bucket_bytes(d: ModelDims, c: int, bucket: int) -> float:
    """The largest bucket of the weight sync (rlhf/distributed/weight_sync.py ``bucket_plan``): tensors in the
    sync dtype (c: the engine's, bf16 under --bf16) up to ``bucket`` bytes, a larger tensor in a bucket of its own:
    max(bucket, c x largest tensor)."""
    return float(max(bucket, c * largest_tensor(d)))


def sync_buffer_bytes(side: str, bucket: float, layer: float, copies: bool, vllm: bool) -> float:
    """What one weight sync holds on a rank beside the resident states, in buckets B (``sync_bucket_bytes``) and
    decoder layers Ly (c x one block) (rlhf/distributed/weight_sync.py; every gathered tensor is in the sync dtype,
    ``full_tensor(p, dtype)``).  ``copies``: the gather makes new tensors (sharded weights, a LoRA merge); an
    unsharded model already in the sync dtype hands its parameters over as they are (no bytes).

        colocated  ``sync_colocated``: the bucket being gathered while the previous one is still bound
                   (``batch = [...]`` rebinds after the list is built): 2 B.  vLLM's ``load_weights`` holds back
                   the last decoder layer until the next bucket completes it (``_pending``): the previous bucket
                   and the held layer overlap, so max(B, Ly) + B.  No copies: 0.
        sender     actor rank sending to rollout ranks of their own (``_send_direct`` / ``_sync_in_process``):
                   the previous bucket's dict while the next is gathered, plus the packed piece in flight, then
                   the next bucket, the piece in flight and the one being packed: 3 B (no copies: 2 B, the packed
                   pieces only).
        receiver   vLLM's workers (``transport.receive_and_load``): the piece being loaded, the next one posted,
                   and the pieces the held-back last layer still views (at most Ly + B): Ly + 3 B.
                   The HF engine in the trainer's process (``_sync_in_process``): the bucket's pieces while the
                   last piece of the previous bucket is still bound: 2 B."""
    if side == "colocated":
        if not copies:
            return 0.0
        return max(bucket, layer) + bucket if vllm else 2 * bucket
    if side == "sender":
        return (3 if copies else 2) * bucket
    return layer + 3 * bucket if vllm else 2 * bucket


def sync_gathering_bytes(d: ModelDims, c: int, dp: int, cast_shard: bool, zero3: bool) -> float:
    """The collective's own transient beside the gathered tensor it returns, for the largest tensor
    (``weight_sync.full_tensor``): FSDP2 casts the local shard to the sync dtype before ``full_tensor()`` when the
    stored dtype differs (fp32 masters under --bf16): c x largest / dp; DeepSpeed ZeRO-3 gathers the parameter in
    place (``GatheredParameters``) and copies it out: c x largest while both exist."""
    if zero3:
        return float(c * largest_tensor(d))
    return float(c * largest_tensor(d)) / dp if cast_shard else 0.0


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_shapes(d: ModelDims, target_modules: str) -> Dict[str, tuple]:
    """(in, out) of each targeted linear of a decoder block; "all-linear" (peft: every linear but the LM head) is
    all seven."""
    h, q, kv, i = d.hidden, d.q_dim, d.kv_dim, d.intermediate
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
              "up_proj": (h, i), "down_proj": (i, h)}
    names = LORA_MODULES if target_modules == "all-linear" else [t.strip() for t in target_modules.split(",")]
    return {n: shapes[n] for n in names if n in shapes}


def lora_adapter_params(d: ModelDims, rank: int, target_modules: str) -> int:
    """Adapter weights of --lora_rank r over the targeted linears (peft: A is r x in, B is out x r):
    L x sum over targets of r (in + out)."""
    return d.layers * sum(rank * (a + b) for a, b in lora_shapes(d, target_modules).values())


def lora_merge_bytes(d: ModelDims, c: int, target_modules: str, copies: bool) -> float:
    """The sync's LoRA merge of the largest targeted weight, n = in x out elements (``weight_sync._export``:
    ``(base.float() + scaling * (B.float() @ A.float())).to(dtype)``): the gathered base (c n, when a copy) and,
    at the peak, three fp32 temporaries (base.float(), B @ A, its scaled copy; base.float() is the base itself in
    an fp32 run): (c + 12) n under --bf16, (4 + 8) n in fp32."""
    n = max((a * b for a, b in lora_shapes(d, target_modules).values()), default=0)
    return float(((c if copies else 0) + (12 if c < 4 else 8)) * n)


def load_host_bytes(n: int, stored: int, adapters: int = 0) -> float:
    """Host memory of the rank that reads a role's checkpoint (FSDP2 ``load_on_first``: rlhf/engines/fsdp2.py
    ``host_copies``): the whole model in its stored dtype, stored x N (+ 4 A fp32 adapters), freed tensor by
    tensor as ``fill_from_first`` sends them; the other ranks build on meta and hold none."""
    return float(stored * n + 4 * adapters)


def kv_cache_bytes(d: ModelDims, seqs: int, tokens: int, c: int) -> float:
    """A KV cache for ``seqs`` sequences of ``tokens`` tokens: 2 (k, v) x L x kv x c per token."""
    return float(2 * d.layers * d.kv_dim * c * seqs * tokens)


def vllm_share_bytes(utilization: float, device_bytes: float) -> float:
    """vLLM v1 takes ``gpu_memory_utilization x total`` for weights, activations and KV cache
    (vllm/v1/worker/gpu_worker.py ``determine_available_memory``; rlhf/engines/vllm_launch.py
    ``check_free_memory`` refuses less free memory at start)."""
    return utilization * device_bytes


def vllm_weight_bytes(n: int, tp: int) -> float:
    """vLLM's weights on one TP rank: bf16, N / TP (the part of its share a level-2 sleep discards and a weight
    sync wakes)."""
    return 2.0 * n / tp
