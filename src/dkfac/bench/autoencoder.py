"""``dkfac bench autoencoder``: training loss against time, digits deep autoencoder.

The Hinton–Salakhutdinov autoencoder (``build_model("autoencoder")``: 64-1000-500-250-30 and
mirrored) reconstructs the 8×8 digits (pixels in [0, 1]) under a mean squared error, for SGD,
AdamW, Muon (with AdamW), SOAP (heavyball, optional) and K-FAC (``dkfac.bench.peers``; Adam on
request), each for the same wall-clock budget. The protocol is ``dkfac.bench.sweep``'s:
equal-size lr grids swept for ``--sweep-seconds`` each on ``--sweep-seed`` (least time to
``--target-loss``, then the lowest final loss, wins), then ``--seconds`` runs on ``--seeds``
seeds interleaved. The training loss over the whole training set is measured every
``--eval-every`` steps outside the clock. With ``--exact-target`` every seeded run also gets
an untimed twin (the same model, batches and optimizer) evaluated after every step: the
first step whose loss reaches the target, and the timed run's training seconds up to that
step, are the exact figures (:func:`exact_hit`), with no evaluation between timed steps.

Default grids (three learning rates each): SGD 0.2 0.5 1.0; Adam and AdamW 0.0003 0.001 0.003;
Muon 0.02 0.05 0.1 (its AdamW part at 0.001, ``muon:adamw_lr``); SOAP 0.001 0.003 0.01;
K-FAC 0.3 1.0 3.0 (its KL-clip bounds the step, so its lr matters little above 1).

Headline figures: the median time to ``--target-loss`` (0.02), and, when SGD runs, the time to
SGD's final training loss (that of the worst SGD seed, which every SGD run reaches within its
budget) against SGD's whole budget.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac.app.data import batches, load_digits
from dkfac.app.models import build_model
from dkfac.bench.arguments import BenchParser
from dkfac.bench.common import (
    command_line,
    first_reaching,
    format_table,
    machine_info,
    write_result,
)
from dkfac.bench.peers import OptimizerSpec, build_optimizer
from dkfac.bench.sweep import (
    add_peer_arguments,
    build_specs,
    check_peer_flags,
    digits_batch_problem,
    plot_loss_vs_time_and_steps,
    split_available,
    sweep_then_seeds,
    table_cell,
)

# The best configuration measured: MC Fisher, statistics from
# half of each 512-sample batch, factors every 5 steps and inverses every 10.
DEFAULT_KFAC = (
    "kfac:method=cholesky,fisher=mc,factor_update_interval=5,inverse_update_interval=10,"
    "damping=0.003,kl_clip=0.01,factor_batch_size=256",
)

GRIDS: dict[str, tuple[float, ...]] = {
    "sgd": (0.2, 0.5, 1.0),
    "adam": (3e-4, 1e-3, 3e-3),
    "adamw": (3e-4, 1e-3, 3e-3),
    "muon": (0.02, 0.05, 0.1),
    "soap": (1e-3, 3e-3, 1e-2),
    "kfac": (0.3, 1.0, 3.0),
}
"""Default learning-rate grids, the same size for every kind."""

TASK_OPTIONS = {"muon": {"adamw_lr": 1e-3}}
"""Muon's AdamW part at Adam's best lr on this task."""


def full_loss(model: nn.Module, x: Tensor) -> float:
    """Mean squared reconstruction error over ``x`` (no gradients)."""
    with torch.no_grad():
        return float(F.mse_loss(model(x), x.flatten(1)).item())


def task_model() -> nn.Module:
    """The task's autoencoder, of the digits' 8x8 images."""
    return build_model("autoencoder", in_channels=1, image_size=8, num_classes=0)


def _training(
    spec: OptimizerSpec, lr: float, seed: int, x: Tensor, *, batch_size: int, momentum: float
) -> tuple[nn.Module, Iterator[float]]:
    """The model and an endless iterator of training steps, each yielding its seconds (the
    zeroing, forward, backward and optimizer step). Two calls with the same arguments train
    the same model on the same batches: a run and its untimed twin."""
    torch.manual_seed(seed)
    model = task_model()
    optimizer = build_optimizer(spec, model, lr, momentum)
    mc_fisher = spec.kind == "kfac" and spec.options.get("fisher") == "mc"
    gen = torch.Generator().manual_seed(seed)

    def steps() -> Iterator[float]:
        while True:
            for xb, _ in batches(x, x, batch_size, shuffle=True, generator=gen, drop_last=True):
                start = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                output = model(xb)
                if mc_fisher:  # G from sampled targets: the Gauss-Newton of the squared error
                    optimizer.preconditioner.sample_fisher(output, "mse")  # type: ignore[attr-defined]
                F.mse_loss(output, xb.flatten(1)).backward()
                optimizer.step()
                yield time.perf_counter() - start

    return model, steps()


def train_for(
    spec: OptimizerSpec,
    lr: float,
    seed: int,
    x: Tensor,
    *,
    batch_size: int,
    seconds: float,
    eval_every: int,
    momentum: float,
    exact_target: float | None = None,
    max_steps: int | None = None,
) -> dict[str, Any]:
    """Trains for ``seconds`` of training time (or ``max_steps`` steps, if fewer); returns
    the loss trace (evaluated every ``eval_every`` steps and after the last).

    With ``exact_target``, also :func:`exact_hit`: the first step at which the training
    loss is at most that, found by an untimed twin evaluated after every step, and this
    run's training time up to that step.

    Returns:
        ``{"lr", "seed", "trace": [[step, seconds, train_loss], ...], "steps", "final_loss"}``
        and, with ``exact_target``, ``"exact_hit"``.
    """
    model, steps = _training(spec, lr, seed, x, batch_size=batch_size, momentum=momentum)
    trace = [(0, 0.0, full_loss(model, x))]
    elapsed, step, clock = 0.0, 0, []
    for step_seconds in steps:
        elapsed += step_seconds
        step += 1
        clock.append(elapsed)
        last = elapsed >= seconds or step == max_steps
        if step % eval_every == 0 or last:
            trace.append((step, elapsed, full_loss(model, x)))
        if last:
            break
    run = {
        "lr": lr,
        "seed": seed,
        "trace": [list(t) for t in trace],
        "steps": step,
        "final_loss": trace[-1][2],
    }
    if exact_target is not None:
        twin = _training(spec, lr, seed, x, batch_size=batch_size, momentum=momentum)
        run["exact_hit"] = exact_hit(twin, x, exact_target, trace, clock)
    return run


def _same(a: float, b: float) -> bool:
    """Equal to the bit, a NaN (a diverged run) equal to a NaN."""
    return a == b or (math.isnan(a) and math.isnan(b))


def exact_hit(
    twin: tuple[nn.Module, Iterator[float]],
    x: Tensor,
    target: float,
    trace: list[tuple[int, float, float]],
    clock: list[float],
) -> dict[str, Any]:
    """The exact step and time to ``target`` of a timed run, from its untimed twin.

    The timed run evaluates every ``eval_every`` steps, so its first evaluation at or below
    the target can lie up to ``eval_every − 1`` steps after the step that reached it; an
    evaluation after every step would instead put the evaluation's cache traffic into
    every timed step. The twin (the same model, batches and optimizer) is evaluated after
    each of its steps, untimed, up to the timed run's step count.

    Args:
        twin: :func:`_training` of the same arguments.
        x: The training set.
        target: The training loss to reach.
        trace: The timed run's ``(step, seconds, loss)`` evaluations.
        clock: The timed run's cumulative training seconds after each step.

    Returns:
        ``{"step", "seconds", "consistent"}``: the first step whose loss is at most
        ``target`` and the timed run's training seconds up to it (``None`` for both when no
        step reached it); ``consistent`` is whether the twin's loss equals the timed run's,
        to the bit, at each of the timed run's evaluations up to the twin's last step (the
        hit; a NaN equals a NaN), else the twin trained another way (e.g. a
        non-deterministic kernel) and the step may not be the timed run's.
    """
    model, steps = twin
    losses = {0: full_loss(model, x)}
    hit = 0 if losses[0] <= target else None
    step = 0
    while hit is None and step < len(clock):
        next(steps)
        step += 1
        losses[step] = full_loss(model, x)
        if losses[step] <= target:
            hit = step
    consistent = all(_same(losses[s], loss) for s, _, loss in trace if s in losses)
    seconds = None if hit is None else (clock[hit - 1] if hit else 0.0)
    return {"step": hit, "seconds": seconds, "consistent": consistent}


def _score(run: dict[str, Any], target: float) -> tuple[float, float]:
    """Sort key of a sweep run: seconds to ``target`` (inf if missed), then final loss."""
    hit = first_reaching(run["trace"], target, higher_is_better=False)
    return (hit[1] if hit is not None else math.inf), run["final_loss"]


def summarise(runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """Medians over seeds: final loss, steps, and steps and seconds to ``target`` (a miss
    counts as infinite)."""
    hits = [first_reaching(r["trace"], target, higher_is_better=False) for r in runs]
    summary = {
        "median_final_loss": statistics.median(r["final_loss"] for r in runs),
        "median_steps": statistics.median(r["steps"] for r in runs),
        "reached_target": sum(h is not None for h in hits),
        "median_seconds_to_target": statistics.median(h[1] if h else math.inf for h in hits),
        "median_steps_to_target": statistics.median(h[0] if h else math.inf for h in hits),
    }
    exact = [r["exact_hit"] for r in runs if "exact_hit" in r]
    if exact and len(exact) == len(runs):
        summary["median_exact_steps_to_target"] = statistics.median(
            math.inf if e["step"] is None else e["step"] for e in exact
        )
        summary["median_exact_seconds_to_target"] = statistics.median(
            math.inf if e["seconds"] is None else e["seconds"] for e in exact
        )
        summary["exact_consistent"] = all(e["consistent"] for e in exact)
    return summary


def add_sgd_comparison(
    summary: dict[str, dict[str, Any]], runs: dict[str, list[dict[str, Any]]], budget: float
) -> float | None:
    """Adds each entry's time to SGD's worst final loss, over SGD's budget; returns that loss
    (``None``, adding nothing, when SGD did not run)."""
    if "sgd" not in runs:
        return None
    sgd_final = float(max(r["final_loss"] for r in runs["sgd"]))
    for name, entry in summary.items():
        hits = [first_reaching(r["trace"], sgd_final, higher_is_better=False) for r in runs[name]]
        seconds = statistics.median(h[1] if h is not None else math.inf for h in hits)
        entry["median_seconds_to_sgd_final"] = seconds
        entry["time_vs_sgd_budget"] = seconds / budget
    return sgd_final


def add_time_vs_fastest(summary: dict[str, dict[str, Any]]) -> None:
    """Sets ``time_vs_fastest``: median seconds to target over the least of any optimizer
    (``None`` when no optimizer reached the target in most seeds); likewise
    ``exact_time_vs_fastest`` from the exact times, where they were measured."""
    for key, ratio in (
        ("median_seconds_to_target", "time_vs_fastest"),
        ("median_exact_seconds_to_target", "exact_time_vs_fastest"),
    ):
        timed = [e for e in summary.values() if key in e]
        fastest = min((e[key] for e in timed), default=math.inf)
        for entry in timed:
            ok = math.isfinite(fastest) and fastest > 0
            entry[ratio] = entry[key] / fastest if ok else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark; returns the JSON payload."""
    x = load_digits(seed=args.split_seed, normalize=False).x_train
    specs, skipped = split_available(build_specs(args, DEFAULT_KFAC, TASK_OPTIONS))

    def train(spec: OptimizerSpec, lr: float, seed: int, sweeping: bool) -> dict[str, Any]:
        momentum = args.kfac_momentum if spec.kind == "kfac" else args.momentum
        seconds = args.sweep_seconds if sweeping else args.seconds
        return train_for(
            spec,
            lr,
            seed,
            x,
            batch_size=args.batch_size,
            seconds=seconds,
            eval_every=args.eval_every,
            momentum=momentum,
            exact_target=None if sweeping or not args.exact_target else args.target_loss,
        )

    runs = sweep_then_seeds(
        specs,
        train,
        lambda r: _score(r, args.target_loss),
        sweep_seed=args.sweep_seed,
        seeds=args.seeds,
        no_sweep=args.no_sweep,
        first_seed=args.first_seed,
        sweep_seeds=args.sweep_seeds,
    )
    summary = {
        name: {"lr": runs.chosen[name], **summarise(seeded, args.target_loss)}
        for name, seeded in runs.seeded.items()
    }
    add_time_vs_fastest(summary)
    sgd_final = add_sgd_comparison(summary, runs.seeded, args.seconds)
    return {
        "benchmark": "autoencoder",
        "machine": machine_info("cpu"),
        "settings": {**vars(args), "specs": [vars(s) for s in specs]},
        "skipped": skipped,
        "sgd_final_loss": sgd_final,
        "sweep": runs.sweep,
        "runs": runs.seeded,
        "summary": summary,
    }


def plot(payload: dict[str, Any], path: str) -> None:
    """Training loss against seconds and steps, every seed of every optimizer, log scale."""
    plot_loss_vs_time_and_steps(
        payload,
        path,
        ylabel="training MSE",
        title=f"digits deep autoencoder ({payload['settings']['seeds']} seeds)",
        target=payload["settings"]["target_loss"],
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``bench autoencoder`` flags."""
    p = BenchParser(prog="dkfac bench autoencoder", description=__doc__)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--seconds", type=float, default=40.0, help="training budget per run")
    p.add_argument("--sweep-seconds", type=float, default=10.0, help="budget of a sweep run")
    p.add_argument(
        "--split-seed", type=int, default=0, help="seed of the split whose train part is used"
    )
    p.add_argument("--target-loss", type=float, default=0.02, help="training MSE to reach")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument(
        "--exact-target",
        action="store_true",
        help="also the exact step to the target of each seeded run, from an untimed twin "
        "evaluated after every step, and the run's training time to that step",
    )
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum")
    p.add_argument(
        "--kfac-momentum",
        type=float,
        default=0.0,
        help="momentum of the SGD inside K-FAC (default 0: the KL-clip sets the step)",
    )
    aliases = {"sgd": "--sgd-lr", "adam": "--adam-lr", "kfac": "--kfac-lr"}
    add_peer_arguments(p, GRIDS, aliases)
    p.add_argument("--name", default="autoencoder_digits")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--plot", default=None, help="PNG path for the loss-vs-time plot")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    return p


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    check_peer_flags(
        p,
        args,
        positive=("batch_size", "target_loss", "seconds", "sweep_seconds", "eval_every", "seeds"),
        problems=(digits_batch_problem(args.batch_size, args.split_seed),),
        momenta=("momentum", "kfac_momentum"),
        default_kfac=DEFAULT_KFAC,
        task_options=TASK_OPTIONS,
        model=task_model,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dkfac bench autoencoder``."""
    p = build_parser()
    args = p.parse_args(argv)
    _validate(p, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    payload = run(args)
    write_result(args.name, payload, args.out_dir, command_line("dkfac bench autoencoder", argv))
    if args.plot:
        plot(payload, args.plot)
    rows = [
        [
            name,
            e["lr"],
            e["median_steps"],
            e["median_final_loss"],
            f"{e['reached_target']}/{args.seeds}",
            table_cell(e["median_steps_to_target"]),
            table_cell(e["median_seconds_to_target"]),
            table_cell(e["time_vs_fastest"]),
            table_cell(e.get("median_seconds_to_sgd_final")),
        ]
        + (
            [
                table_cell(e.get("median_exact_steps_to_target")),
                table_cell(e.get("median_exact_seconds_to_target")),
                table_cell(e.get("exact_time_vs_fastest")),
            ]
            if args.exact_target
            else []
        )
        for name, e in payload["summary"].items()
    ]
    print(f"target training MSE {args.target_loss}, {args.seconds:g} s per run, median over seeds")
    if payload["sgd_final_loss"] is not None:
        print(f"SGD final training loss (worst seed): {payload['sgd_final_loss']:.4g}")
    headers = ["optimizer", "lr", "steps", "final loss", "reached", "steps to target"]
    headers += ["s to target", "× fastest", "s to SGD final"]
    if args.exact_target:
        headers += ["exact steps", "exact s", "exact × fastest"]
        if not all(e.get("exact_consistent", True) for e in payload["summary"].values()):
            print("warning: a twin run did not train as its timed run (exact_consistent)")
    print(format_table(headers, rows))
    for name, reason in payload["skipped"].items():
        print(f"{name}: skipped ({reason})")
    return 0
