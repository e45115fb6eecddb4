#!/usr/bin/env bash
# The GPU runs (issue 7's step costs, and eigen_adam's), in one command for a lent accelerator.
# Uses the machine's own python3 with PyTorch (nothing is installed); results go to $1
# (default benchmarks/results). On the device tool: `bash benchmarks/gpu_runs.sh $OUT`.
# Each run is interleaved SGD / AdamW / K-FAC steps on one model and batch, the median of the
# repeats. The runs go smallest first under one deadline ($GPU_RUNS_SECONDS, default 540 s),
# so a short lease still brings back the small models; a run the deadline cuts writes nothing
# and the script says so. First the CUDA tests and the conv factor paths (bench conv-paths),
# then the language model's step phases on the GPU (the recipe beside Muon and AdamW). The
# language model's side-by-sides are benchmarks/gpu_lm_runs.sh, after this.
set -uo pipefail
out="${1:-benchmarks/results}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
end=$((SECONDS + ${GPU_RUNS_SECONDS:-540}))
py() {
  local left=$((end - SECONDS))
  if ((left < 30)); then echo "not run (deadline): $*"; return; fi
  echo "== $* (at most ${left} s)"
  local start=$SECONDS
  timeout "$left" python3 -m dkfac bench step --device cuda --out-dir "$out" "$@" \
    || echo "FAILED or cut by the deadline (rc $?): $*"
  echo "   $((SECONDS - start)) s"
}
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" \
  || exit 1
echo "== the CUDA tests (skipped where there is no GPU, so CI never runs them)"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py \
  tests/bench/test_bench_lm.py::test_a_run_on_the_gpu_follows_the_same_run_on_the_cpu \
  tests/app/test_devices.py \
  || echo "FAILED or cut (rc $?): the CUDA tests"
echo "== host time of for_model's plain step: the CPU probe's thin models, on the GPU"
timeout 120 python3 benchmarks/probes/host_time.py --device cuda \
  --out "$out/host_time_plain_step_cuda.json" \
  || echo "FAILED or cut (rc $?): the host-time probe"
echo "== the conv factor's three exact paths on the GPU (auto unfolds there: check it)"
timeout 120 python3 -m dkfac bench conv-paths --device cuda --repeats 2 \
  --out "$out/conv_factor_paths_cuda.json" \
  || echo "FAILED or cut (rc $?): the conv factor paths"
echo "== language model step phases on the GPU"
timeout 150 python3 -m dkfac bench phases --device cuda \
  --steps 60 --out "$out/lm_phases_cuda.json" muon adamw benchmarks/recipes/gpt-text.toml \
  || echo "FAILED or cut (rc $?): the GPU step phases"
for model in resnet20 resnet32 resnet56; do
  py --model "$model" --batch-size 128 --repeats 5 --with-reduction --factor-batch-size 32 \
     --name "step_${model}_cuda"
done
py --model resnet20 --batch-size 128 --repeats 5 --method eigen_adam \
   --options basis_refresh=power,rotation_dtype=bfloat16 --name step_resnet20_cuda_eigen_adam
py --model gpt --layers 4 --width 128 --heads 4 --seq-len 128 --batch-size 32 --repeats 5 \
   --method eigen_adam --options basis_refresh=power,rotation_dtype=bfloat16 \
   --name step_gpt_cuda_eigen_adam
# for_model's options (its overhead budget aside), as the dispatch counts take them
default=moment_nesterov=true,basis_refresh=power,moment_carry=reset,kl_clip=none
default=$default,flattened_inputs=graph,orthogonal_layers=role:hidden
py --model resnet20 --batch-size 128 --repeats 5 --method eigen_adam --options "$default" \
   --name step_resnet20_cuda_default
py --model gpt --layers 4 --width 128 --heads 4 --seq-len 128 --batch-size 32 --repeats 5 \
   --method eigen_adam --options "$default" --name step_gpt_cuda_default
# the same, each group's update compiled (Triton kernels; the first steps compile)
py --model resnet20 --batch-size 128 --repeats 5 --method eigen_adam \
   --options "$default,compile_step=inductor" --name step_resnet20_cuda_default_compiled
py --model gpt --layers 4 --width 128 --heads 4 --seq-len 128 --batch-size 32 --repeats 5 \
   --method eigen_adam --options "$default,compile_step=inductor" \
   --name step_gpt_cuda_default_compiled
# One configuration (factors from 32 samples, products in bf16): with four (and the exact
# factors) the run did not end within 73 s on an H200.
py --model resnet50 --image-size 224 --batch-size 128 --repeats 3 --autocast bf16 \
   --options factor_batch_size=32,capture_dtype=bfloat16 --name step_resnet50_cuda_bf16
