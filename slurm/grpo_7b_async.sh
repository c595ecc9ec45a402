#!/bin/bash
#SBATCH --job-name=grpo-7b-async
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=64
#SBATCH --gpus-per-node=8
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@1560
#SBATCH --requeue

# grpo-7b-async: 1 node(s) x 8 ranks. Extra flags after the script name
# override the config, e.g.  sbatch slurm/<this>.sh --actor_learning_rate 1e-6
# USR1 1560s before the time limit (finish the step, save, requeue): 1.5 x (step ~918s + save ~98s) rounded up to minutes, floor 300s; 7.0B params from the name 'Qwen/Qwen2.5-7B-Instruct'; 98 GB of checkpoint over 1 node(s) at 1 GB/s each
export RLHF_SIGNAL_LEAD_S=1560
source "${RLHF_HOME:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
rlhf_run rlhf.train_grpo --config "$RLHF_HOME/configs/grpo_qwen2.5_7b_async.yaml" --load_checkpoint --start_fresh_if_no_checkpoint "$@"
