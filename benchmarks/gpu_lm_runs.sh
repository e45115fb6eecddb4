#!/usr/bin/env bash
# The language-model runs of a lent GPU machine. First on the GPU: Muon
# (torch.optim.Muon as shipped, bf16) and the recipe side by side for 30 s on two seeds, the
# steps interleaved (dkfac bench lm-interleaved --device cuda). Then on the host CPU, which may
# multiply bf16 natively where this project's VM emulates it: the step phases of Muon, AdamW
# and the recipe, and the 60 s side-by-side on two seeds. One process at a time, the CPU runs
# one thread pinned to one core ($GPU_LM_CORE, default 8): run it after
# benchmarks/gpu_runs.sh, not beside it (on the H200 machine of 2026-11-27, eight one-thread
# runs side by side made every step about 8 times slower). About 9 minutes. Uses the
# machine's own python3; results go to $1 (default benchmarks/results).
#   bash benchmarks/gpu_lm_runs.sh $OUT
set -uo pipefail
out="${1:-benchmarks/results}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
recipe=benchmarks/recipes/gpt-text.toml
core="${GPU_LM_CORE:-8}"
timeout 200 python3 -m dkfac bench lm-interleaved --device cuda --seeds 2 \
  --first-seed 200 --no-sweep --seconds 30 --eval-every 100 --optimizers muon kfac \
  --muon-lrs 0.05 --recipe "$recipe" --name lm_gpt_interleaved_cuda \
  --out-dir "$out" || echo "FAILED (rc $?): GPU side-by-side"
lscpu | grep -E "Model name|^CPU\(s\)" || true
grep -o -w -E "avx512_bf16|amx_bf16" /proc/cpuinfo | sort | uniq -c
python3 -c "import torch; print(torch.__version__, torch.backends.cpu.get_cpu_capability())"
taskset -c "$core" timeout 120 python3 -m dkfac bench phases --steps 20 \
  --out "$out/lm_phases_host.json" muon adamw "$recipe" || echo "FAILED (rc $?): phases"
taskset -c "$core" timeout 330 python3 -m dkfac bench lm-interleaved --threads 1 \
  --seeds 2 --first-seed 200 --no-sweep --seconds 60 --eval-every 25 --optimizers muon kfac \
  --muon-lrs 0.05 --recipe "$recipe" --name lm_gpt_interleaved_host \
  --out-dir "$out" || echo "FAILED (rc $?): side-by-side"
