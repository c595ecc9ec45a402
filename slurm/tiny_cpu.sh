#!/bin/bash
#SBATCH --job-name=tiny-cpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=00:20:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@300
#SBATCH --requeue

# tiny-cpu: 1 node(s) x 2 ranks. Extra flags after the script name
# override the config, e.g.  sbatch slurm/<this>.sh --actor_learning_rate 1e-6
# USR1 300s before the time limit (finish the step, save, requeue): floor 300s: model size unknown from no --pretrain (the built-in tiny model); pass --signal_lead_s
export RLHF_SIGNAL_LEAD_S=300
# TERM (scancel, a preemption): torchrun gives the ranks 60s to save before SIGKILL (floor 60s: model size unknown from no --pretrain (the built-in tiny model));
# SLURM kills after its KillWait (slurm.conf, often 30 s): ask for KillWait >= 90s, or stop with
# `scancel --signal=USR1 --batch <job>` (no deadline: finish the step, save, requeue)
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-60}"
export GPUS_PER_NODE=${GPUS_PER_NODE:-2}
source "${RLHF_HOME:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
rlhf_run rlhf.train_sft --config "$RLHF_HOME/configs/sft_tiny.yaml" --save_steps 20 --max_global_steps 40 --load_checkpoint --start_fresh_if_no_checkpoint "$@"
