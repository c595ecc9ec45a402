#!/bin/bash
#SBATCH --job-name=grpo-7b-async
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=64
#SBATCH --gpus-per-node=8
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@1680
#SBATCH --requeue

# grpo-7b-async: 1 node(s) x 8 ranks. Extra flags after the script name
# override the config, e.g.  sbatch slurm/<this>.sh --actor_learning_rate 1e-6
# USR1 1680s before the time limit (finish the step, save, requeue): 1.5 x (step ~918s + save ~196s) rounded up to minutes, floor 300s; 7.0B params from the name 'Qwen/Qwen2.5-7B-Instruct'; 98 GB of checkpoint over 1 node(s) at 1 GB/s each, read back for its hashes at 1 GB/s
# Data: the config's openai/gsm8k@main ('@' names a data_dir, as in OpenRLHF: gsm8k has the configs main and
# socratic and no default). Nodes without internet read the HF cache: fill it once where there is internet with
#   python -c "import datasets; datasets.load_dataset('openai/gsm8k', data_dir='main')"
export RLHF_SIGNAL_LEAD_S=1680
# TERM (scancel, a preemption): torchrun gives the ranks 1020s to save before SIGKILL (1.5 x (0.5 x step ~918s + save ~196s) rounded up to minutes, floor 60s);
# SLURM kills after its KillWait (slurm.conf, often 30 s): ask for KillWait >= 1050s, or stop with
# `scancel --signal=USR1 --batch <job>` (no deadline: finish the step, save, requeue)
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-1020}"
source "${RLHF_HOME:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
rlhf_run rlhf.train_grpo --config "$RLHF_HOME/configs/grpo_qwen2.5_7b_async.yaml" --load_checkpoint --start_fresh_if_no_checkpoint "$@"
