#!/usr/bin/env bash
# The one prepared script for a lent GPU (H200): GPU-marked tests, the vLLM engine tests, then the GPU benchmark
# (vLLM rollout tokens/s vs bare vLLM, weight sync GB/s into vLLM, memory freed by sleep, MFU). Under 10 minutes.
#   bash bench/gpu.sh            (the device tool runs it in a copy of the tree; results land in $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
OUT="${OUT:-bench/results}"; mkdir -p "$OUT" bench/results
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
python -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null | tee -a "$OUT/gpu.txt" || echo "vllm: not installed" | tee -a "$OUT/gpu.txt"
timeout 180 python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -20 | tee "$OUT/gpu_tests.txt"
# the vLLM engine on CUDA (direct weight loader, sleep): the single-process tests; TP=2 needs 2 GPUs
timeout 240 python -m pytest -q tests/test_vllm.py -k "not two_ranks and not separate" -p no:cacheprovider 2>&1 \
  | tail -20 | tee "$OUT/vllm_tests.txt"
timeout 300 python bench/gpu_bench.py 2>&1 | tail -30 | tee "$OUT/gpu_bench.txt"
