#!/bin/bash
#SBATCH --job-name=ppo-70b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=64
#SBATCH --gpus-per-node=8
#SBATCH --time=48:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@2160
#SBATCH --requeue

# ppo-70b: 4 node(s) x 8 ranks. Extra flags after the script name
# override the config, e.g.  sbatch slurm/<this>.sh --actor_learning_rate 1e-6
# USR1 2160s before the time limit (finish the step, save, requeue): 1.5 x (step ~918s + save ~490s) rounded up to minutes, floor 300s; 70.0B params from the name 'meta-llama/Meta-Llama-3-70B-Instruct'; 1960 GB of checkpoint over 4 node(s) at 1 GB/s each
export RLHF_SIGNAL_LEAD_S=2160
source "${RLHF_HOME:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
rlhf_run rlhf.train_ppo --config "$RLHF_HOME/configs/ppo_llama3_70b_hybrid.yaml" --load_checkpoint --start_fresh_if_no_checkpoint "$@"
