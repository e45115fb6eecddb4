#!/usr/bin/env bash
# Issue 7's GPU runs, in one command for a lent accelerator (none was lent so far).
# Uses the machine's own python3 with PyTorch (nothing is installed); results go to $1
# (default benchmarks/results). On the device tool: `bash benchmarks/gpu_runs.sh $OUT`.
# About 6 minutes on an H100/H200; each run is interleaved SGD vs K-FAC, median of 5.
set -euo pipefail
out="${1:-benchmarks/results}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py() { python3 -m dkfac bench step --device cuda --repeats 5 --out-dir "$out" "$@"; }
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
py --model resnet50 --image-size 224 --batch-size 128 --autocast bf16 \
   --with-reduction --factor-batch-size 32 --capture-dtype bfloat16 --name step_resnet50_cuda_bf16
for model in resnet20 resnet32 resnet56; do
  py --model "$model" --batch-size 128 --with-reduction --factor-batch-size 32 \
     --name "step_${model}_cuda"
done
