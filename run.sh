#!/usr/bin/env bash
# Single-node mock-run launcher. Uncomment the case you want, or pass your own flags after the script name:
#   bash run.sh --steps 50
set -euo pipefail
cd "$(dirname "$0")"

# CPU: tiny preset, hetero, 4 processes (vision dp2 on ranks 0-1 + language dp2 on ranks 2-3)
OMP_NUM_THREADS=1 torchrun --nproc_per_node=4 train.py --preset tiny --steps 20 "$@"

# GPU: 20l on 8 GPUs, reference layout (vision tp2 dp2 on 0-3 + language tp2 dp2 ep4 on 4-7), seq 8192,
# one 2048x2048 image per sample
# torchrun --nproc_per_node=8 train.py --preset 20l --steps 20 --metrics-file runs/20l.jsonl "$@"

# GPU: 2-GPU hetero small (vision on GPU 0, language on GPU 1)
# torchrun --nproc_per_node=2 train.py --preset small --vision-dp 1 --lm-dp 1 --steps 20 "$@"
