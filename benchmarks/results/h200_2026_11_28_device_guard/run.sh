#!/usr/bin/env bash
# One lease: the CUDA tests, then before (e0234a9) / after step costs side by side.
set -uo pipefail
out=$1; mkdir -p "$out"
export PYTHONUNBUFFERED=1
end=$((SECONDS + ${BUDGET:-290}))
left() { echo $((end - SECONDS)); }
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
echo "== CUDA tests"
PYTHONPATH=$PWD/src timeout 60 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py tests/engine/test_device_checks.py 2>&1 | tail -15
bench() {  # version name args...
  local v=$1 name=$2; shift 2
  local t=$(left); if ((t < 20)); then echo "not run: $v $name"; return; fi
  local src=$PWD/src; [[ $v == base ]] && src=$PWD/.gpu/base_src
  echo "== $v $name (<= ${t}s)"; local s=$SECONDS
  PYTHONPATH=$src timeout "$t" python3 -m dkfac bench step --device cuda --out-dir "$out" --name "${name}_${v}" "$@" 2>&1 \
    | grep -v -i "warn" | tail -6 || echo "FAILED $v $name"
  echo "   $((SECONDS - s)) s"
}
for v in head base; do bench $v step_resnet20_cuda --model resnet20 --batch-size 128 --repeats 5; done
for v in head base; do bench $v step_gpt_cuda_eigen_adam --model gpt --layers 4 --width 128 --heads 4 --seq-len 128 --batch-size 32 --repeats 5 --method eigen_adam --options basis_refresh=power,rotation_dtype=bfloat16; done
for v in head base; do bench $v step_resnet20_cuda_eigen_adam --model resnet20 --batch-size 128 --repeats 5 --method eigen_adam --options basis_refresh=power,rotation_dtype=bfloat16; done
bench head step_resnet50_cuda_bf16 --model resnet50 --image-size 224 --batch-size 128 --repeats 3 --autocast bf16 --options factor_batch_size=32,capture_dtype=bfloat16
ls "$out"
