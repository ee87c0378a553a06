#!/usr/bin/env bash
# SLURM batch script: the 20l preset on 2 nodes x 8 GPUs, hetero: vision tp2 dp4 (8 ranks) + language tp2 ep4 dp4
# (8 ranks; memory per rank: train.py --dry-run --world-size 16 ...). One torchrun agent per node, c10d rendezvous
# on the first node. SIGTERM 10 minutes before the time limit leaves time for the signal save (docs/failures.md
# §3); the same line resubmitted resumes (--save = --load). Submit: sbatch run_slurm.sh [more train.py flags]
#SBATCH --job-name=hetero-vlm-20l
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=02:00:00
#SBATCH --signal=TERM@600
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")}"
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun torchrun --nnodes="$SLURM_NNODES" --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint="$head:29500" \
    --rdzv_id="$SLURM_JOB_ID" train.py --preset 20l --vision-tp 2 --vision-dp 4 --lm-tp 2 --lm-dp 4 --lm-ep 4 \
    --steps 20 --save runs/20l-2x8 --load runs/20l-2x8 --metrics-file "runs/20l-2x8-$SLURM_JOB_ID.jsonl" "$@"
