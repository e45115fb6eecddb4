"""The protocol of a peer comparison: lr grids of equal size, a sweep, then seeds.

Shared by ``bench tta``, ``bench autoencoder`` and ``bench lm``:

1. **Optimizers**: ``--optimizers`` picks kinds (:data:`dkfac.bench.peers.KINDS`); ``kfac``
   stands for every ``--kfac NAME:options`` variant and every ``--recipe FILE``
   (:mod:`dkfac.bench.recipes`: a ``dkfac train --config`` file, named after its stem), or
   for the benchmark's default variants when neither flag is given; a ``--recipe`` without
   ``kfac`` among ``--optimizers`` is an error. One whose optional package is missing (SOAP
   without heavyball) is skipped with a log line and recorded as skipped.
2. **Grids**: every optimizer gets the same number of learning rates (``--<kind>-lrs``; a
   recipe's are its lr times powers of two, :func:`dkfac.bench.recipes.recipe_grid`), so none
   is tuned harder than another.
3. **Sweep** (recorded): round ``i`` runs the ``i``-th learning rate of every optimizer on
   each of the ``--sweep-seeds`` sweep seeds (``--sweep-seed`` onwards), optimizers
   interleaved; the lr whose median run (by the task's score) is best wins. One sweep seed
   (the default) picks by a single run, which on digits moved a recipe's lr by 2x and its
   median step count by 2; three are steadier, for every
   optimizer alike.
4. **Seeds**: every optimizer runs at its chosen lr on seeds ``0 .. --seeds-1``, seed-major,
   optimizers inner, so machine noise hits all alike.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from dkfac.app.data import load_digits
from dkfac.bench.common import parse_options
from dkfac.bench.muon_precision import use_float32_muon
from dkfac.bench.peers import (
    KINDS,
    PEER_OPTIONS,
    OptimizerSpec,
    build_optimizer,
    check_kfac_options,
    resolve_options,
)
from dkfac.bench.peers import unavailable_reason as _unavailable_reason
from dkfac.bench.recipes import load_recipe

logger = logging.getLogger(__name__)

DEFAULT_OPTIMIZERS = ("sgd", "adamw", "muon", "soap", "kfac")
"""Kinds run unless ``--optimizers`` says otherwise (``adam`` only when asked for)."""

Run = dict[str, Any]
Train = Callable[[OptimizerSpec, float, int, bool], Run]
"""``train(spec, lr, seed, sweeping)`` -> one run's record."""


@dataclass
class Comparison:
    """Every run of a comparison: the sweep, the chosen lrs and the seeded runs."""

    sweep: dict[str, list[Run]]
    chosen: dict[str, float]
    seeded: dict[str, list[Run]]


def add_peer_arguments(
    parser: argparse.ArgumentParser,
    grids: Mapping[str, Sequence[float]],
    aliases: Mapping[str, str] | None = None,
    optimizers: Sequence[str] = DEFAULT_OPTIMIZERS,
) -> None:
    """Adds the optimizer-selection, grid and sweep flags.

    Args:
        parser: The benchmark's parser.
        grids: Kind -> its default learning-rate grid (every kind of ``KINDS``).
        aliases: Kind -> an older spelling of its grid flag that stays accepted.
        optimizers: The kinds run unless ``--optimizers`` says otherwise.
    """
    parser.add_argument(
        "--muon-dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="precision of Muon's Newton-Schulz iteration: bfloat16 (torch.optim.Muon as "
        "shipped) or float32 (for a CPU that emulates bf16)",
    )
    parser.add_argument(
        "--optimizers",
        nargs="+",
        choices=KINDS,
        default=list(optimizers),
        help="optimizer kinds to run; kfac runs every --kfac variant and --recipe "
        "(default: %(default)s)",
    )
    for kind in KINDS:
        flags = [f"--{kind}-lrs", *([aliases[kind]] if aliases and kind in aliases else [])]
        parser.add_argument(
            *flags,
            dest=f"{kind}_lrs",
            type=float,
            nargs="+",
            default=list(grids[kind]),
            help=f"{kind}'s learning-rate grid (default: %(default)s)",
        )
    parser.add_argument("--kfac", action="append", help="NAME:key=value,... (repeatable)")
    parser.add_argument(
        "--recipe",
        action="append",
        default=[],
        metavar="FILE",
        help="a K-FAC recipe: a dkfac train --config TOML file, run as a kfac variant named "
        "after the file (repeatable)",
    )
    parser.add_argument(
        "--peer-options",
        action="append",
        default=[],
        metavar="KIND:key=value,...",
        help="options of a peer kind, e.g. muon:adamw_lr=0.003 (repeatable)",
    )
    parser.add_argument("--only", nargs="+", help="run only these optimizer names")
    parser.add_argument(
        "--no-sweep", action="store_true", help="skip the sweep: use the first lr of each grid"
    )
    parser.add_argument("--sweep-seed", type=int, default=100, help="the first sweep seed")
    parser.add_argument(
        "--sweep-seeds",
        type=int,
        default=1,
        help="seeds per swept lr: --sweep-seed onwards; the median run scores the lr",
    )
    parser.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="the measured runs use seeds FIRST .. FIRST+seeds-1 (held-out seeds: e.g. 10)",
    )


def peer_options(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``["muon:adamw_lr=0.003", ...]`` -> ``{"muon": {"adamw_lr": 0.003}}``.

    Raises:
        ValueError: For a kind that takes no peer options, or a malformed item.
    """
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        kind, sep, text = item.partition(":")
        if not sep or kind not in PEER_OPTIONS:
            raise ValueError(
                f"--peer-options {item!r}: expected KIND:key=value,... with KIND one of "
                f"{', '.join(PEER_OPTIONS)}"
            )
        out.setdefault(kind, {}).update(parse_options(text))
    return out


def build_specs(
    args: argparse.Namespace,
    default_kfac: Sequence[str],
    task_options: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[OptimizerSpec]:
    """The optimizers of the run, from the flags of :func:`add_peer_arguments`.

    Args:
        args: Parsed flags.
        default_kfac: ``NAME:options`` K-FAC variants used when no ``--kfac`` is given.
        task_options: Kind -> the task's defaults over :data:`~dkfac.bench.peers.DEFAULT_OPTIONS`
            (``--peer-options`` overrides both).

    Raises:
        ValueError: For a bad option or recipe, a ``--recipe`` without ``kfac`` among
            ``--optimizers``, a ``--kfac`` without its ``NAME``, an unknown ``--only`` name,
            duplicate names, a learning rate not finite and > 0, grids of different sizes
            (unless ``--no-sweep``), or a negative seed.
    """
    for flag in ("first_seed", "sweep_seed", "split_seed"):
        if getattr(args, flag, 0) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if getattr(args, "sweep_seeds", 1) < 1:
        raise ValueError(f"--sweep-seeds must be >= 1, got {args.sweep_seeds}")
    given = peer_options(args.peer_options)
    recipes = [load_recipe(path) for path in args.recipe]
    if recipes and "kfac" not in args.optimizers:
        raise ValueError("--recipe adds a K-FAC variant: keep kfac among --optimizers")
    specs: list[OptimizerSpec] = []
    for kind in dict.fromkeys(args.optimizers):
        lrs = list(getattr(args, f"{kind}_lrs"))
        if kind != "kfac":
            options = resolve_options(kind, (task_options or {}).get(kind), given.get(kind))
            specs.append(OptimizerSpec(kind, kind, lrs, options))
            check_peer_builds(specs[-1])
            continue
        for text in args.kfac or ([] if recipes else default_kfac):
            name, _, opts = text.partition(":")
            if not name or "=" in name:  # 'damping=-1' ran as a K-FAC variant so named
                raise ValueError(f"--kfac takes NAME:key=value,... (NAME first), got {text!r}")
            options = parse_options(opts)
            check_kfac_options(options)
            specs.append(OptimizerSpec(name, "kfac", lrs, options))
        size = _other_grid_size(args)
        specs += [recipe.spec(size, sweep=not args.no_sweep) for recipe in recipes]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"optimizer names must be unique, got {', '.join(names)}")
    if unknown := sorted(set(args.only or []) - set(names)):
        raise ValueError(f"--only: no optimizer named {', '.join(unknown)} (have {names})")
    specs = [s for s in specs if not args.only or s.name in args.only]
    if not all(0 < lr < math.inf for s in specs for lr in s.lrs):  # NaN fails too
        raise ValueError("learning rates must be finite and > 0")
    if not args.no_sweep:
        check_grids(specs)
    return specs


def check_peer_builds(spec: OptimizerSpec, model: Callable[[], nn.Module] | None = None) -> None:
    """Builds ``spec`` once over a fresh ``model()`` (default: a small MLP), so that an
    option value the optimizer itself refuses (torch's ``ValueError`` for a negative
    ``weight_decay``, a NaN ``adamw_lr``, an unknown ``adjust_lr_fn``; for K-FAC over the
    task's model, a ``skip_layers`` that leaves it no layer) is a flag error before any run.

    Raises:
        ValueError: Naming the flag (``--peer-options KIND``, ``--kfac NAME`` or ``--recipe
            FILE``) and what the optimizer said.
    """
    if _unavailable_reason(spec.kind) is not None:
        return  # reported (and skipped) where the run meets it
    probe: nn.Module
    if model is None:
        probe = nn.Sequential(
            nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)
        )
    else:
        probe = model()
    lr = spec.lrs[0] if spec.lrs and 0 < spec.lrs[0] < math.inf else 1e-3
    if spec.kind != "kfac":
        flag = f"--peer-options {spec.kind}"
    else:
        flag = f"--recipe {spec.recipe['path']}" if spec.recipe else f"--kfac {spec.name}"
    try:
        build_optimizer(spec, probe, lr, 0.0)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{flag}: {error}") from None


def _other_grid_size(args: argparse.Namespace) -> int:
    """The grid size a recipe matches: that of the first other optimizer that runs (the
    first peer kind, else the ``--kfac`` variants' grid)."""
    peers = [kind for kind in args.optimizers if kind != "kfac"]
    return len(getattr(args, f"{peers[0]}_lrs" if peers else "kfac_lrs"))


def digits_batch_problem(batch_size: int, split_seed: int) -> str | None:
    """Why ``--batch-size`` does not fit the digits training split (``None``: it does): the
    epochs drop their last partial batch, so a larger batch took no step, forever."""
    train = len(load_digits(seed=split_seed).y_train)
    if batch_size > train:
        return f"--batch-size {batch_size} exceeds the {train} training samples of digits"
    return None


def check_peer_flags(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    *,
    positive: Sequence[str],
    problems: Sequence[str | None] = (),
    momenta: Sequence[str] = ("momentum",),
    default_kfac: Sequence[str],
    task_options: Mapping[str, Mapping[str, Any]] | None = None,
    model: Callable[[], nn.Module] | None = None,
) -> None:
    """The checks every peer benchmark makes of its flags, each a one-line ``parser.error``.

    With ``--muon-dtype float32`` it also switches Muon's iteration to float32 for the process
    (:mod:`dkfac.bench.muon_precision`).

    Args:
        parser: The benchmark's parser.
        args: Its parsed flags.
        positive: Destinations of the flags that must be > 0, in the order the error names them.
        problems: The benchmark's own findings, checked next: the first message that is not
            ``None`` is the error.
        momenta: Destinations of the flags that must be in [0, 1).
        default_kfac: As for :func:`build_specs`, which checks the optimizers last.
        task_options: As for :func:`build_specs`.
        model: A fresh model of the task on each call: every K-FAC variant is built over one
            (:func:`check_peer_builds`), so that options the preconditioner refuses for that
            model (a ``skip_layers`` that leaves it no layer) fail before any run.
    """
    if getattr(args, "muon_dtype", "bfloat16") == "float32":
        use_float32_muon()  # every Muon run of this process
    for name in positive:  # NaN fails too
        if not 0 < (value := getattr(args, name)) < math.inf:
            parser.error(f"--{name.replace('_', '-')} must be finite and > 0, got {value}")
    if problem := next((found for found in problems if found is not None), None):
        parser.error(problem)
    if (threads := getattr(args, "threads", None)) is not None and threads < 1:
        parser.error(f"--threads must be >= 1, got {threads}")  # torch's error was a traceback
    for name in momenta:
        if not 0 <= (value := getattr(args, name)) < 1:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1), got {value}")
    try:
        specs = build_specs(args, default_kfac, task_options)
        for spec in specs if model is not None else ():
            if spec.kind == "kfac":
                check_peer_builds(spec, model)
    except ValueError as error:
        parser.error(str(error))


def check_grids(specs: Sequence[OptimizerSpec]) -> None:
    """Every optimizer must sweep the same number of learning rates.

    Raises:
        ValueError: Naming each grid's size when they differ.
    """
    sizes = {s.name: len(s.lrs) for s in specs}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{name} {n}" for name, n in sizes.items())
        raise ValueError(
            f"every optimizer needs the same number of learning rates, got {listed} "
            "(or pass --no-sweep to run the first of each)"
        )


def split_available(
    specs: Sequence[OptimizerSpec],
    unavailable_reason: Callable[[str], str | None] = _unavailable_reason,
) -> tuple[list[OptimizerSpec], dict[str, str]]:
    """The specs that can run here, and ``name -> reason`` for those skipped (logged)."""
    runnable, skipped = [], {}
    for spec in specs:
        reason = unavailable_reason(spec.kind)
        if reason is None:
            runnable.append(spec)
        else:
            logger.warning("skipping %s: %s", spec.name, reason)
            skipped[spec.name] = reason
    return runnable, skipped


def sweep_then_seeds(
    specs: Sequence[OptimizerSpec],
    train: Train,
    score: Callable[[Run], tuple[float, ...]],
    *,
    sweep_seed: int,
    seeds: int,
    no_sweep: bool,
    first_seed: int = 0,
    sweep_seeds: int = 1,
) -> Comparison:
    """Runs the sweep (unless ``no_sweep``: then the first lr of each grid) and the seeds.

    Args:
        specs: The optimizers, in the order they interleave.
        train: Runs one optimizer at one lr on one seed (``sweeping`` tells it which phase).
        score: Sort key of a sweep run, lowest best.
        sweep_seed: The first seed of the sweep runs.
        seeds: How many seeds the measured runs use: ``first_seed .. first_seed+seeds-1``.
        no_sweep: Skip the sweep.
        first_seed: The first seed of the measured runs.
        sweep_seeds: Sweep seeds per lr (``sweep_seed`` onwards); an lr scores as its median
            run (the lower middle one for an even count).
    """
    sweep: dict[str, list[Run]] = {s.name: [] for s in specs}
    for i in range(0 if no_sweep else max((len(s.lrs) for s in specs), default=0)):
        for seed in range(sweep_seed, sweep_seed + sweep_seeds):
            for s in specs:
                if i < len(s.lrs):
                    sweep[s.name].append(train(s, s.lrs[i], seed, True))
                    logger.info("sweep %s lr=%g seed %d done", s.name, s.lrs[i], seed)
    chosen = {s.name: _best_lr(sweep[s.name], score, s.lrs[0]) for s in specs}
    seeded: dict[str, list[Run]] = {s.name: [] for s in specs}
    for seed in range(first_seed, first_seed + seeds):
        for s in specs:
            seeded[s.name].append(train(s, chosen[s.name], seed, False))
    return Comparison(sweep, chosen, seeded)


def _best_lr(runs: Sequence[Run], score: Callable[[Run], tuple[float, ...]], first: float) -> float:
    """The lr whose median run scores lowest (the first lr of the grid when none ran)."""
    by_lr: dict[float, list[Run]] = {}
    for run in runs:
        by_lr.setdefault(run["lr"], []).append(run)
    if not by_lr:
        return first

    def median_score(lr: float) -> tuple[float, ...]:
        ranked = sorted(by_lr[lr], key=score)
        return score(ranked[(len(ranked) - 1) // 2])

    return min(by_lr, key=median_score)


def table_cell(value: float | None) -> float | str:
    """A summary figure for :func:`~dkfac.bench.common.format_table`: ``-`` when it is
    undefined (``None``) or not finite (a missed target, a diverged run)."""
    return "-" if value is None or not math.isfinite(value) else value


def plot_runs(
    ax: Any, runs: Mapping[str, Sequence[Run]], key: str, x: int, y: int, lrs: Mapping[str, float]
) -> None:
    """Draws column ``y`` against column ``x`` of every run's ``key`` trace, one colour per
    optimizer (every seed; the legend names each optimizer once, with its lr)."""
    for i, (name, seeded) in enumerate(runs.items()):
        for j, run in enumerate(seeded):
            ax.plot(
                [t[x] for t in run[key]],
                [t[y] for t in run[key]],
                color=f"C{i % 10}",
                alpha=0.8,
                linewidth=1.0,
                label=f"{name} (lr {lrs[name]:g})" if j == 0 else None,
            )


def plot_loss_vs_time_and_steps(
    payload: Mapping[str, Any],
    path: str,
    *,
    ylabel: str,
    title: str,
    target: float | None = None,
) -> None:
    """Saves a PNG of two panels, a loss against training seconds and against steps: every
    seed of every optimizer of ``payload["runs"]`` (traces ``[step, seconds, loss]``), log
    scale, a dashed line at ``target`` when given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(12, 4.5))
    lrs = {name: entry["lr"] for name, entry in payload["summary"].items()}
    plot_runs(ax_t, payload["runs"], "trace", 1, 2, lrs)
    plot_runs(ax_s, payload["runs"], "trace", 0, 2, lrs)
    for ax, xlabel in ((ax_t, "training seconds"), (ax_s, "steps")):
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", lw=0.8)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
