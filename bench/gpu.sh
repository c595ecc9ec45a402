#!/usr/bin/env bash
# The one prepared script for a lent GPU (one H200, torch 2.11, transformers 5.17; no vLLM, DeepSpeed, datasets,
# submitit, wandb; click, pyyaml, psutil are in its image, so nothing is carried). Under 10 minutes:
#   1. a Qwen2.5-0.5B-shaped model built from its config (nothing downloaded), the tiny kit's tokenizer and data;
#   2. train_sft, train_rm, train_dpo, train_grpo (--rollout_engine hf --colocate_all_models --bf16), a few steps,
#      at 1 rank (cuda:nccl) and at 2 ranks on the one GPU with RLHF_DIST_BACKEND=cuda:gloo (no CPU backend: a
#      CPU tensor in a collective fails there as on NCCL);
#   3. comm's collectives and the RL stages' gathers at 2 ranks with CUDA tensors (cuda:gloo), and whether gloo
#      runs FSDP2's all_gather_into_tensor / reduce_scatter_tensor on CUDA tensors;
#   4. the matmul peak, the memory planner's predicted vs measured peak per stage (bench/memory_plan_check.py),
#      tests/test_gpu.py, the vLLM section (skipped when vLLM is not importable);
#   5. a summary table: master-parameter dtype, batch device, peak memory per phase, rank-0 peak at FSDP2 load vs
#      model bytes, train MFU.
#   bash bench/gpu.sh            on the GPU machine (the device tool runs it in a copy of the tree; results in $OUT)
#   bash bench/gpu.sh --smoke    the same on CPU with the tiny model (gloo at both sizes), to check the script
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=0; [ "${1:-}" = "--smoke" ] && SMOKE=1
export PYTHONPATH="$PWD:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled \
       TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
OUT="${OUT:-bench/results/gpu}"; [ $SMOKE = 1 ] && OUT="${SMOKE_OUT:-bench/results/gpu_smoke}"
rm -rf "$OUT/runs"; mkdir -p "$OUT/runs"; rm -f "$OUT/results.jsonl" "$OUT/failures.txt" "$OUT/collectives.json" \
  "$OUT/memory_plan.jsonl" "$OUT/memory_plan.txt"
KIT="${GPU_CHECK_KIT:-/tmp/rlhf_gpu_check_kit}"
T0=$(date +%s)
if [ $SMOKE = 1 ]; then
  export OMP_NUM_THREADS=1; KITFLAG=--smoke; BACKEND2=""; STEPS=2; GEN=8; RUN_T=240; BUDGET=1200
else
  KITFLAG=""; BACKEND2="cuda:gloo"; STEPS=3; GEN=64; RUN_T=90; BUDGET=330
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
fi
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'cuda', torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"
python bench/gpu_check.py kit --path "$KIT" $KITFLAG || { echo "kit build failed"; exit 1; }
python bench/gpu_check.py peak --out "$OUT"

launch() {  # launch WORLD BACKEND NAME ARGS...: one torchrun, its log in runs/, a failure recorded with its last line
  local world=$1 backend=$2 name=$3; shift 3
  local log="$OUT/runs/${name}_w${world}.log" t=$(date +%s)
  if [ $(( t - T0 )) -gt "$BUDGET" ]; then  # keep the whole script inside the device's 10 minutes
    echo "$name at $world rank(s): skipped, past the ${BUDGET}s budget" | tee -a "$OUT/failures.txt"; return
  fi
  RLHF_DIST_BACKEND="$backend" timeout "$RUN_T" python -m torch.distributed.run --standalone \
    --nproc_per_node "$world" bench/gpu_check.py "$@" --out "$OUT" >"$log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    local why; why=$(grep -E "Error|error:|exceeded|Timeout" "$log" | grep -v Warning | tail -1 | cut -c1-220)
    echo "$name at $world rank(s) [${backend:-default}]: exit $rc: ${why:-see $log}" | tee -a "$OUT/failures.txt"
  fi
  echo "[gpu.sh] $name at $world rank(s): exit $rc in $(( $(date +%s) - t ))s"
}
# the collective discipline first: cheap, and the answer the 2-rank trainer runs depend on
launch 2 "$BACKEND2" collectives collectives
grep "^\[collectives\]" "$OUT/runs/collectives_w2.log" || true
for world in 1 2; do
  backend=""; [ "$world" = 2 ] && backend="$BACKEND2"
  for kind in sft rm dpo grpo; do
    launch "$world" "$backend" "$kind" run --kind "$kind" --kit "$KIT" --steps "$STEPS" --gen_len "$GEN"
  done
done

if [ $SMOKE = 0 ]; then
  # engine-level MFU at a realistic sequence length (the trainers' arithmetic rows are ~30 tokens)
  timeout 75 python bench/mfu.py --device cuda --shape qwen2.5-0.5b --batch 8 --seq 1024 --steps 6 2>&1 \
    | tail -3 | tee "$OUT/mfu.txt"
  # memory planner: predicted vs torch.cuda.max_memory_allocated per stage, Qwen2.5-0.5B shape, fp32 then bf16
  # autocast (~30 s each); only with the time left after keeping 130 s for the GPU tests and the report
  left=$(( 600 - 130 - ($(date +%s) - T0) ))
  if [ "$left" -gt 60 ]; then
    for prec in "" "--bf16"; do
      timeout $(( left / 2 )) python bench/memory_plan_check.py --device cuda --shape qwen2.5-0.5b $prec --prompt 256 \
        --response 512 --micro_train 4 --micro_rollout 8 --out "$OUT/memory_plan.jsonl" 2>&1 | tail -5 \
        | tee -a "$OUT/memory_plan.txt"
    done
  else
    echo "memory plan check: skipped, ${left}s left of the 10 minutes" | tee "$OUT/memory_plan.txt"
  fi
  timeout 100 python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -20 | tee "$OUT/gpu_tests.txt"
  if python -c "import vllm" 2>/dev/null; then
    # the vLLM engine on CUDA (direct weight loader, sleep): the single-process tests; TP=2 needs 2 GPUs
    timeout 240 python -m pytest -q tests/test_vllm.py -k "not two_ranks and not separate" -p no:cacheprovider 2>&1 \
      | tail -20 | tee "$OUT/vllm_tests.txt"
    timeout 300 python bench/gpu_bench.py 2>&1 | tail -30 | tee "$OUT/gpu_bench.txt"
  else
    echo "vLLM: not importable on this machine: the vLLM tests and bench/gpu_bench.py are skipped" | tee "$OUT/vllm_tests.txt"
  fi
fi
if [ $SMOKE = 1 ]; then  # the memory step's script on CPU, small
  timeout 120 python bench/memory_plan_check.py --kit tiny --prompt 32 --response 32 --out "$OUT/memory_plan.jsonl" \
    2>&1 | tail -5 | tee "$OUT/memory_plan.txt"
fi
python bench/gpu_check.py report --out "$OUT" | tee "$OUT/summary.txt"
rc=${PIPESTATUS[0]}
echo "[gpu.sh] done in $(( $(date +%s) - T0 ))s (smoke=$SMOKE), exit $rc"
exit "$rc"
