#!/bin/bash
# SLURM example: 2 nodes x 8 GPUs, DeepSpeed ZeRO-3, one `accelerate launch` per node.
#   sbatch launch/slurm_multinode.sh train.py [script args...]
#SBATCH --job-name=kfac-stream
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --output=%x-%j.out
set -euo pipefail
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR MASTER_PORT=29500
# output_dir (and with it output_dir/kfac) must be on a shared filesystem.
srun --kill-on-bad-exit=1 bash -c 'accelerate launch \
    --config_file launch/multinode_zero3.yaml \
    --num_machines "$SLURM_NNODES" --num_processes $((SLURM_NNODES * 8)) \
    --machine_rank "$SLURM_NODEID" \
    --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" \
    "$@"' _ "$@"
