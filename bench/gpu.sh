#!/usr/bin/env bash
# The one prepared script for a lent GPU (one H100/H200; its image: torch 2.11 + CUDA 13, transformers 5.17, peft,
# accelerate, click, pyyaml, psutil, pytest; no datasets, vLLM, DeepSpeed, flash-attn, wandb, submitit, uvicorn).
# Under 8 minutes. First an import check (a few seconds; the script stops there if it fails), then GATES: each prints
# one verdict line "GATE <name>: PASS|FAIL|SKIP <figures>" and the script exits non-zero if any failed:
#   load_peak          FSDP2 load: the source rank's device peak vs its shards + one full tensor (bench/gpu_gates.py)
#   sft_adam_offload, grpo_adam_offload   one SFT / GRPO step with --adam_offload (inputs on the compute device)
#   grpo_sleep         GRPO with the phase scheduler on (--vllm_enable_sleep --deepspeed_enable_sleep: FSDP2
#                      sleep/wake with Adam state and empty_cache)
#   grpo_refill        refill rounds (--dynamic_filtering with a narrow range, sleep on)
#   grpo_dynamic_batch --use_dynamic_batch;  sft_packing --packing_samples;  sft_lora --lora_rank 8
#   sft_ring_attn      --ring_attn_size 2 on sdpa, 2 ranks on the one GPU (cuda:gloo)
#   collectives        comm's collectives and the RL gathers at 2 ranks on cuda:gloo (CUDA tensors only, as NCCL)
#   comm_init          comm.init under cuda:nccl,cpu:gloo with device_id, new_group, object collectives (torchrun)
#   weight_receiver    tests/multiprocess/test_weight_transfer.py's direct path with the workers' buffers on the GPU
#   head_gap           the fused head's log-prob gap at a 152k vocabulary, bf16 vs fp32 (vs fp64)
#   moe                MoE expert kernels agree (eager/batched_mm/grouped_mm), R3 replay closes routing (bench/moe_gpu.py)
#   master_update      the fraction of weights one fp32-master AdamW step at lr 1e-6 moves
#   gpu_tests          tests/gpu/test_gpu.py (pytest -m gpu)
#   mfu, memory_plan   last: engine-level MFU (bench/mfu.py) and predicted vs measured memory (memory_plan_check.py)
# Every trainer gate records, per phase, max_memory_allocated, max_memory_reserved, mem_get_info's free bytes and
# the pinned host bytes beside the memory planner's prediction for that stage.
# $OUT receives at most 4 files: summary.json, summary.txt, failures.txt, logs.tar.gz (< 16 MiB); trainer outputs
# and logs live in a temporary folder.
#   bash bench/gpu.sh            on the GPU machine (the device tool runs it in a copy of the tree; results in $OUT)
#   bash bench/gpu.sh --smoke    the same on CPU with the tiny model, the GPU image's missing packages blocked
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=0; [ "${1:-}" = "--smoke" ] && SMOKE=1
export PYTHONPATH="$PWD:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled \
       TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
OUT="${OUT:-bench/results/gpu}"; [ $SMOKE = 1 ] && OUT="${SMOKE_OUT:-bench/results/gpu_smoke}"
mkdir -p "$OUT"; rm -f "$OUT/summary.json" "$OUT/summary.txt" "$OUT/failures.txt" "$OUT/logs.tar.gz"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/rlhf_gpu_check.XXXXXX"); mkdir -p "$WORK/logs"
KIT="${GPU_CHECK_KIT:-$WORK/kit}"
T0=$(date +%s)
if [ $SMOKE = 1 ]; then
  export OMP_NUM_THREADS=1; KITFLAG=--smoke; B2="gloo"; STEPS=1; GEN=8; RUN_T=240; BUDGET=1500; VOCAB=8192
  # the GPU image lacks these: block them in every Python process of the smoke run (find_spec then says None)
  mkdir -p "$WORK/block"
  cat > "$WORK/block/sitecustomize.py" <<'EOF'
import os, sys
for _name in os.environ.get("RLHF_BLOCK_IMPORTS", "").split(","):
    if _name:
        sys.modules[_name] = None
EOF
  export PYTHONPATH="$WORK/block:$PYTHONPATH" RLHF_BLOCK_IMPORTS="datasets,vllm,deepspeed,wandb,submitit,uvicorn"
else
  KITFLAG=""; B2="cuda:gloo"; STEPS=2; GEN=32; RUN_T=90; BUDGET=360; VOCAB=151936  # no gate starts after 6 min: the last ends by 8
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$WORK/logs/gpu.txt" 2>&1
fi

gate() {  # gate NAME TIMEOUT CMD...: run CMD, keep its log, record its verdict line (or a FAIL line for it)
  local name=$1 t=$2; shift 2
  local log="$WORK/logs/$name.log" t1; t1=$(date +%s)
  if [ $(( t1 - T0 )) -gt "$BUDGET" ]; then
    echo "GATE $name: FAIL not run: past the ${BUDGET}s budget" | tee -a "$WORK/verdicts.txt"; return
  fi
  timeout "$t" "$@" >"$log" 2>&1
  local rc=$? line why
  line=$(grep "^GATE $name:" "$log" | tail -1)
  if [ -z "$line" ] || { [ $rc -ne 0 ] && [[ "$line" != *": FAIL"* ]]; }; then
    why=$(grep -E "Error|error:|Timeout|exceeded|Killed" "$log" | grep -v Warning | tail -1 | cut -c1-240)
    line="GATE $name: FAIL exit $rc after $(( $(date +%s) - t1 ))s: ${why:-see logs/$name.log}"
  fi
  echo "$line" | tee -a "$WORK/verdicts.txt"
}

train() {  # train NAME WORLD BACKEND KIND FLAGS...: one trainer under torchrun, gpu_check.py prints its verdict
  local name=$1 world=$2 backend=$3 kind=$4; shift 4
  gate "$name" "$RUN_T" env RLHF_DIST_BACKEND="$backend" python -m torch.distributed.run --standalone \
    --nproc_per_node "$world" bench/gpu_check.py run --kind "$kind" --kit "$KIT" --out "$WORK" --name "$name" \
    --steps "$STEPS" --gen_len "$GEN" "$@"
}

gate imports 60 python bench/gpu_gates.py imports
if ! grep -q "^GATE imports: PASS" "$WORK/verdicts.txt"; then
  cat "$WORK/logs/imports.log" | tail -5; cp "$WORK/verdicts.txt" "$OUT/failures.txt"; exit 1
fi
python bench/gpu_check.py kit --path "$KIT" $KITFLAG >"$WORK/logs/kit.log" 2>&1 || { tail -5 "$WORK/logs/kit.log"; exit 1; }

gate load_peak 120 python bench/gpu_gates.py load_peak --kit "$KIT"
train sft_adam_offload 1 "" sft --adam_offload
train grpo_adam_offload 1 "" grpo --adam_offload
train grpo_sleep 1 "" grpo --vllm_enable_sleep --deepspeed_enable_sleep
train grpo_refill 1 "" grpo --vllm_enable_sleep --deepspeed_enable_sleep --remote_rm_url tests/helpers/varied_scores.py \
  --dynamic_filtering --dynamic_filtering_reward_range 0.3 0.7
train grpo_dynamic_batch 1 "" grpo --use_dynamic_batch --train_max_tokens_per_gpu 2048
train sft_packing 1 "" sft --packing_samples
train sft_lora 1 "" sft --lora_rank 8
train sft_ring_attn 2 "$B2" sft --packing_samples --ring_attn_size 2
gate collectives 90 env RLHF_DIST_BACKEND="$B2" python -m torch.distributed.run --standalone --nproc_per_node 2 \
  bench/gpu_check.py collectives --out "$WORK"
gate comm_init 90 python -m torch.distributed.run --standalone --nproc_per_node 1 bench/gpu_gates.py comm_init
gate weight_receiver 120 python bench/gpu_gates.py weight_receiver
gate head_gap 60 python bench/gpu_gates.py head_gap --vocab "$VOCAB"
gate moe 90 python bench/moe_gpu.py  # MoE kernels (grouped_mm) and R3 routing replay on the device (issue 45)
gate master_update 90 python bench/gpu_gates.py master_update --kit "$KIT"

if [ $SMOKE = 0 ]; then  # the GPU-marked tests, then last: engine-level MFU, the planner against the allocator
  gate gpu_tests 100 bash -c 'python -m pytest -q -m gpu tests/gpu/test_gpu.py -p no:cacheprovider \
    && echo "GATE gpu_tests: PASS tests/gpu/test_gpu.py"'
  gate mfu 75 bash -c 'python bench/mfu.py --device cuda --shape qwen2.5-0.5b --batch 8 --seq 1024 --steps 6 \
    && echo "GATE mfu: PASS see logs/mfu.log"'
  gate memory_plan 100 bash -c "python bench/memory_plan_check.py --device cuda --shape qwen2.5-0.5b --bf16 \
    --prompt 256 --response 512 --micro_train 4 --micro_rollout 8 --out $WORK/memory_plan.jsonl \
    && echo 'GATE memory_plan: PASS see logs/memory_plan.log'"
else
  gate memory_plan 120 bash -c "python bench/memory_plan_check.py --kit tiny --prompt 32 --response 32 \
    --out $WORK/memory_plan.jsonl && echo 'GATE memory_plan: PASS see logs/memory_plan.log'"
fi

python bench/gpu_gates.py summary --work "$WORK" --out "$OUT"
rc=$?
cp "$WORK/verdicts.txt" "$WORK/logs/" 2>/dev/null
cp "$WORK"/results.jsonl "$WORK"/memory_plan.jsonl "$WORK/logs/" 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs
if [ "$(stat -c %s "$OUT/logs.tar.gz")" -gt $(( 15 * 1024 * 1024 )) ]; then  # keep under the 16 MiB return limit
  find "$WORK/logs" -name '*.log' -size +512k -exec sh -c 'tail -c 262144 "$1" > "$1.tail" && mv "$1.tail" "$1"' _ {} \;
  tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs
fi
[ "${KEEP_WORK:-0}" = 1 ] || rm -rf "$WORK"
echo "[gpu.sh] done in $(( $(date +%s) - T0 ))s (smoke=$SMOKE), exit $rc"
exit "$rc"
