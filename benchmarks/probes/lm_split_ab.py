"""Probe: the LM recipe's optimizer step before and after section 29's two cuts, in one process.

Builds the ``dkfac bench lm`` model three times (seed 0): Muon (float32 iteration, as
``muon_float32.py``), the recipe with this code, and the recipe with the two cuts undone
for its steps only: the split's generic ``EigenMomentsSolver.split_parts`` (``m̂ ⊘ D`` and
``D^-S`` formed apart, then divided) and the stack's Newton–Schulz as one batched
iteration (``polar.iterate``). Every step all three take the same batch, in alternating
order, and each optimizer step is timed (``time.perf_counter``; the first 5 not counted).
Prints and writes (``--out``) the mean and median milliseconds of each.

    python benchmarks/probes/lm_split_ab.py --steps 40 --out benchmarks/results/lm_split_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import lm_step_phases
import muon_float32
import torch
import torch.nn.functional as F

from dkfac.bench import lm
from dkfac.bench.common import command_line, machine_info
from dkfac.solvers import eigen_moments, polar

RECIPE = "benchmarks/recipes/gpt-text.toml"
NEW_NS = polar.newton_schulz
NEW_SPLIT = eigen_moments.EigenAdamSolver.split_parts


def old_newton_schulz(
    matrix: torch.Tensor, steps: int = polar.NS_STEPS, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The iteration before section 29: a stack as one batched call on every device."""
    return polar.iterate(matrix, steps, dtype)


def use_old_code(old: bool) -> None:
    """Puts the two pieces the cuts replaced back (``old``) or takes them out."""
    polar.newton_schulz = old_newton_schulz if old else NEW_NS  # type: ignore[assignment]
    generic = eigen_moments.EigenMomentsSolver.split_parts
    eigen_moments.EigenAdamSolver.split_parts = generic if old else NEW_SPLIT  # type: ignore[method-assign]


def main() -> None:
    """Parses the arguments, steps the three optimizers in turn, prints and writes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", help="also write the results to this JSON file")
    args = parser.parse_args()
    muon_float32.patch()
    torch.set_num_threads(1)
    task = lm.load_task(lm.build_parser().parse_args(["--threads", "1"]))
    cpu = torch.device("cpu")
    runs = {
        name: lm_step_phases.make(variant, task, cpu)
        for name, variant in (("muon", "muon"), ("recipe", RECIPE), ("recipe_before", RECIPE))
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        index = torch.randint(len(task.x_train), (32,), generator=gen)
        xb, yb = task.x_train[index], task.y_train[index]
        order = list(runs.items())
        for name, (model, optimizer) in order if step % 2 else reversed(order):
            use_old_code(name == "recipe_before")
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(xb).flatten(0, 1), yb.flatten()).backward()
            start = time.perf_counter()
            optimizer.step()
            if step >= lm_step_phases.WARMUP:
                times[name].append((time.perf_counter() - start) * 1e3)
    use_old_code(False)
    table = {
        name: {"mean_ms": statistics.mean(t), "median_ms": statistics.median(t)}
        for name, t in times.items()
    }
    for name, entry in table.items():
        print(
            f"{name}: optimizer step {entry['mean_ms']:.1f} ms mean, "
            f"{entry['median_ms']:.1f} median"
        )
    if args.out:
        command = command_line("python benchmarks/probes/lm_split_ab.py", None)
        payload = {"command": command, "machine": machine_info(cpu), "settings": vars(args)}
        with open(args.out, "w") as handle:
            json.dump({**payload, "optimizer_step": table, "times_ms": times}, handle, indent=1)


if __name__ == "__main__":
    main()
