#!/usr/bin/env bash
# On a machine with CUDA GPUs, with a model large enough to matter (12 layers x 768 hidden,
# sequence 1024, bf16), one rank per GPU:
#  1. the trainer benchmark: the step-time ratio against the plain DDP loop (at the default
#     log_every and at log_every 1), tokens/s and MFU;
#  2. on a one-node local cluster: `infractl plan --measure` (the planner's prediction beside
#     torch.cuda.max_memory_allocated, component by component) and a one-node `infractl bench`.
# It prints the figures to paste in docs/performance.md and docs/sizing.md. Nothing in CI needs a
# GPU; this is for the machines the project runs on for real.
#
#   bench/gpu.sh [more bench/trainer.py options, e.g. --json gpu.json]
#
# It installs into .venv-gpu: on a GPU machine pip's default torch==2.13.0 wheel is the CUDA build
# (the CPU build that the other scripts pin comes from this project's CI machines only).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "bench/gpu.sh: no CUDA GPU here (nvidia-smi -L found none); run bench/trainer.py instead" >&2
  exit 2
fi
export INFRACTL_VENV="${INFRACTL_VENV:-$repo/.venv-gpu}"
source "$repo/scripts/bootstrap.sh"
gpus="$(nvidia-smi -L | wc -l)"
python - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"bench/gpu.sh: torch {torch.__version__} in this venv has no CUDA; install a CUDA build of torch==2.13.0")
PY
cd "$repo"
python bench/trainer.py --world "$gpus" --model 12x768 --seq-len 1024 --batch-size "$((8 * gpus))" --bf16 \
  --only-step-time "$@"

work="$(mktemp -d)"
cd "$work"
cat >cluster.yaml <<YAML
name: gpu
provider: local
nodes: 1
processes_per_node: $gpus
YAML
cat >run.yaml <<YAML
name: gpu-12x768
model: {layers: 12, hidden: 768, heads: 12, seq_len: 1024}
batch_size: $((8 * gpus))
steps: 60
parallel: fsdp
mixed_precision: bf16
checkpoint: {every: 50, keep: 1}
nodes: {min: 1, max: 1}
YAML
infractl up -c cluster.yaml
trap 'infractl teardown -c gpu --yes' EXIT
infractl plan run.yaml --device "${INFRACTL_PLAN_DEVICE:-h100-80gb}" --gpus-per-node "$gpus"  # the catalog entry of this GPU
infractl plan run.yaml --measure -c gpu
infractl bench run.yaml --nodes 1 -c gpu
