# Sourced by the sbatch scripts in slurm/: job env, InfiniBand/NCCL defaults, preemption -> checkpoint -> requeue.
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
export RLHF_HOME="${RLHF_HOME:-$PWD}"   # the checkout (configs/, slurm/); the job's outputs go to the submit dir
export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
export MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
export GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
# InfiniBand / NCCL: defaults only, whatever the user exported wins (the one table: launch/env.py NCCL_DEFAULTS)
eval "$(cd "$RLHF_HOME" && python -m launch.env --exports)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
export TOKENIZERS_PARALLELISM=false
export RLHF_STOP_FILE="${RLHF_STOP_FILE:-$PWD/output/slurm-$SLURM_JOB_ID.stop}"
mkdir -p output "$(dirname "$TORCH_FR_DUMP_TEMP_FILE")"   # NCCL flight-recorder dumps land there on a hang
rm -f "$RLHF_STOP_FILE"
echo "[slurm] job $SLURM_JOB_ID: $SLURM_NNODES node(s) x $GPUS_PER_NODE ranks, rendezvous $MASTER_ADDR:$MASTER_PORT" \
     "(restart ${SLURM_RESTART_COUNT:-0})"

SRUN_PID=""
# USR1 comes from --signal=B:USR1@$RLHF_SIGNAL_LEAD_S before the time limit (or `scancel --signal=USR1 --batch`):
# finish the step, checkpoint, then requeue ourselves; the restart resumes with --load_checkpoint. The lead time is
# sized per script from the model and recipe (launch/sbatch.py signal_lead_s; README, SLURM).
on_usr1() {
  echo "[slurm] USR1 (time limit or preemption notice): asking the trainers to checkpoint"
  touch "$RLHF_STOP_FILE"
  [ -n "$SRUN_PID" ] && wait "$SRUN_PID" || true
  rm -f "$RLHF_STOP_FILE"
  echo "[slurm] requeueing $SLURM_JOB_ID; the next start resumes with --load_checkpoint"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
}
# TERM is scancel, or a preemption that SLURM requeues itself: checkpoint within KillWait, never requeue here.
on_term() {
  echo "[slurm] TERM: asking the trainers to checkpoint before the job ends"
  touch "$RLHF_STOP_FILE"
  [ -n "$SRUN_PID" ] && wait "$SRUN_PID" || true
  exit 143
}
trap on_usr1 USR1
trap on_term TERM

# rlhf_run MODULE [FLAGS...]: one srun task per node, each running torchrun over the node's ranks.
rlhf_run() {
  local module="$1"; shift
  srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
    python -m torch.distributed.run --nnodes "$SLURM_NNODES" --nproc_per_node "$GPUS_PER_NODE" \
      --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$SLURM_JOB_ID" \
      -m "$module" "$@" &
  SRUN_PID=$!
  wait "$SRUN_PID"
}
