#!/bin/bash
#SBATCH --job-name=ppo-8b
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=64
#SBATCH --gpus-per-node=8
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@1980
#SBATCH --requeue

# ppo-8b: 1 node(s) x 8 ranks. Extra flags after the script name
# override the config, e.g.  sbatch slurm/<this>.sh --actor_learning_rate 1e-6
# USR1 1980s before the time limit (finish the step, save, requeue): 1.5 x (step ~839s + save ~448s) rounded up to minutes, floor 300s; 8.0B params from the name 'OpenRLHF/Llama-3-8b-sft-mixture'; 224 GB of checkpoint over 1 node(s) at 1 GB/s each, read back for its hashes at 1 GB/s
export RLHF_SIGNAL_LEAD_S=1980
# TERM (scancel, a preemption): torchrun gives the ranks 1320s to save before SIGKILL (1.5 x (0.5 x step ~839s + save ~448s) rounded up to minutes, floor 60s);
# SLURM kills after its KillWait (slurm.conf, often 30 s): ask for KillWait >= 1350s, or stop with
# `scancel --signal=USR1 --batch <job>` (no deadline: finish the step, save, requeue)
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-1320}"
source "${RLHF_HOME:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
rlhf_run rlhf.train_ppo --config "$RLHF_HOME/configs/ppo_llama3_8b.yaml" --load_checkpoint --start_fresh_if_no_checkpoint "$@"
