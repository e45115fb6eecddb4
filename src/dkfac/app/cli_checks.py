"""The training program's range and consistency checks of its parsed arguments.

Each check calls ``parser.error`` (one message, exit code 2) on the first problem, before
any training starts; :func:`check_args` runs them all for ``dkfac train`` and ``compare``.
"""

from __future__ import annotations

import argparse
import contextlib
import re

from dkfac.app.devices import device_error
from dkfac.app.domains import DOMAINS, check_domains
from dkfac.app.gpt import size_problem
from dkfac.app.models import LANGUAGE_MODELS
from dkfac.app.parallel import flag_problem
from dkfac.app.pathnames import long_name
from dkfac.app.runconfig import dkfac_defaults, kfac_config_from_args
from dkfac.app.schedules import parse_piecewise
from dkfac.app.session import KFAC_RUNS
from dkfac.config import check_schedule_value
from dkfac.optimizer import DEFAULT_LR

__all__ = ["DEFAULT_LRS", "OPTIMIZERS", "check_args", "default_lr"]

OPTIMIZERS = ("sgd", "adam", "adamw", "muon", "kfac", "kfac-adam", "dkfac")
"""The optimizers ``--optimizer`` and ``--optimizers`` take."""

DEFAULT_LRS = {
    "dkfac": DEFAULT_LR,
    "kfac": 0.05,
    "kfac-adam": 0.001,
    "sgd": 0.05,
    "adam": 0.001,
    "adamw": 0.001,
    "muon": 0.02,
}
"""Each optimizer's learning rate where neither ``--lr`` nor ``--lrs`` gives one: dkfac's
is ``for_model``'s (:data:`~dkfac.optimizer.DEFAULT_LR`), Adam's and AdamW's torch's
default, Muon's the usual 0.02 of its hidden matrices, SGD's and K-FAC under SGD's the
training program's 0.05."""


def default_lr() -> str:
    """``--lr``'s help for its default: each optimizer's rate of :data:`DEFAULT_LRS`."""
    rates = ", ".join(f"{n} {lr:g}" for n, lr in DEFAULT_LRS.items())
    return f"the optimizer's own: {rates}"


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Range and consistency checks; calls ``parser.error`` (exit 2) on the first problem."""
    if message := check_domains(args):
        parser.error(message)
    if args.nesterov and (args.momentum == 0 or "adam" in args.optimizer):
        parser.error("--nesterov needs SGD (sgd or kfac) with --momentum > 0")
    if args.warmup_epochs > args.epochs:
        parser.error(f"--warmup-epochs ({args.warmup_epochs}) exceeds --epochs ({args.epochs})")
    if list(args.milestones) != sorted(args.milestones):
        parser.error(f"--milestones must be increasing epochs >= 0, got {args.milestones}")
    if args.schedule == "step" and not args.milestones:
        parser.error("--schedule step needs --milestones")
    if args.data in ("cifar10", "cifar100") and args.data_dir is None:
        parser.error(f"--data {args.data} needs --data-dir (the CIFAR python archive)")
    if args.stop_at_target and args.target_accuracy is None:
        parser.error("--stop-at-target needs --target-accuracy")
    if args.model == "autoencoder" and (args.mixup or args.label_smoothing):
        parser.error("--mixup and --label-smoothing apply to classifiers, not the autoencoder")
    if args.model == "autoencoder" and args.target_accuracy is not None:
        parser.error("the autoencoder has no accuracy; drop --target-accuracy")
    if message := device_error(args.device):
        parser.error(message)
    for dest in ("out", "resume", "data_dir", "text_path"):  # "" was read as "." or skipped
        value = getattr(args, dest, None)
        if value == "":
            parser.error(f"--{dest.replace('_', '-')} is empty: give a path (or leave it out)")
        if value is not None and (problem := long_name(value)):
            parser.error(f"--{dest.replace('_', '-')} {value!r} {problem}")
    if args.resume == "auto" and args.out is None:
        parser.error(
            "--resume auto continues the run in --out: give --out RUN (without it every run "
            "starts in a new runs/<timestamp> folder)"
        )
    if args.resume is not None and args.overwrite:
        parser.error("--overwrite starts the run folder afresh; it cannot go with --resume")
    _check_recipe(args, parser)
    _check_language_model(args, parser)
    _check_lrs(args, parser)
    if message := flag_problem(args):
        parser.error(message)
    if args.command == "compare":
        names = [n.strip() for n in args.optimizers.split(",")]
        bad = [n for n in names if n not in OPTIMIZERS]  # an empty name too ("sgd,,adam")
        if not names or bad or len(set(names)) != len(names):
            parser.error(
                f"--optimizers must list distinct names from {OPTIMIZERS}, got {args.optimizers!r}"
            )
        args.optimizers = ",".join(names)
        if args.resume not in (None, "auto"):
            parser.error("dkfac compare takes --resume auto (each optimizer's own folder)")
    _check_kfac(args, parser)


def _check_lrs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--lrs NAME=LR ...``: known optimizers, once each, rates in ``--lr``'s domain; applied to
    ``args.lr`` for ``train``, or :data:`DEFAULT_LRS` where neither gives one (``compare``
    applies them per optimizer: :func:`dkfac.app.trainer.optimizer_lr`)."""
    rates: dict[str, float] = {}
    for item in args.lrs:
        name, _, value = str(item).partition("=")
        try:
            rate = float(value)
        except ValueError:
            rate = float("nan")
        if name not in OPTIMIZERS or name in rates or not DOMAINS["lr"].contains(rate):
            parser.error(
                f"--lrs takes OPTIMIZER=LR with an optimizer from {', '.join(OPTIMIZERS)} "
                f"(each once) and an LR {DOMAINS['lr'].describe()}, got {item!r}"
            )
        rates[name] = rate
    args.lrs = [f"{name}={rate!r}" for name, rate in rates.items()]
    if args.command == "train" and args.optimizer in rates:
        args.lr = rates[args.optimizer]
    elif args.command == "train" and args.lr is None:
        args.lr = DEFAULT_LRS[args.optimizer]


def _check_kfac(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The K-FAC flags: :class:`KFACConfig`'s own checks, schedules, ``--skip-layers`` regexes."""
    for pattern in args.skip_layers:
        try:
            re.compile(pattern)
        except re.error as err:
            parser.error(f"--skip-layers {pattern!r} is not a regular expression: {err}")
    names = args.optimizers.split(",") if args.command == "compare" else [args.optimizer]
    kfac = [n for n in names if n in KFAC_RUNS]
    # Checked as `dkfac` reads them when it is the only K-FAC optimizer of the run.
    defaults = dkfac_defaults(args) if kfac == ["dkfac"] else None
    checked = argparse.Namespace(**vars(args))
    if checked.lr is None:  # compare: each optimizer's own rate, resolved per run
        checked.lr = min(DEFAULT_LRS[name] for name in kfac or names)
    try:
        kfac_config_from_args(checked, defaults=defaults)
        for name, value in vars(args).items():
            if name.endswith("_schedule") and value is not None:
                field = name.removesuffix("_schedule")
                for _, piece in parse_piecewise(value):
                    with contextlib.suppress(KeyError):  # a field without a known range
                        check_schedule_value(field, piece)
    except (ValueError, TypeError) as err:
        parser.error(f"invalid K-FAC option: {err}")


def _check_recipe(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Checks of the large-batch recipe flags (SP-NGD)."""
    if args.mixup_mode == "running" and args.mixup <= 0:
        parser.error("--mixup-mode running needs --mixup ALPHA > 0")
    if args.weight_rescale and args.weight_decay != 0:
        parser.error("--weight-rescale replaces weight decay; pass --weight-decay 0")
    if args.batch_norm and args.model != "cnn":
        parser.error(f"--batch-norm applies to --model cnn (got {args.model})")


def _check_language_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Checks of ``--model gpt``, ``--data text`` and their flags."""
    problem = size_problem(args.layers, args.width, args.heads, args.seq_len)
    if problem is not None:
        parser.error(problem)
    factory = ":" in args.model
    if args.model in LANGUAGE_MODELS and args.data != "text":
        parser.error(f"--model {args.model} reads token ids: use it with --data text")
    if args.data == "text" and args.model not in LANGUAGE_MODELS and not factory:
        parser.error(
            f"--data text needs a language model: --model {' or '.join(LANGUAGE_MODELS)} "
            f"or package.module:factory (got {args.model})"
        )
    if args.data == "text" and (args.mixup or args.augment == "on"):
        parser.error("--mixup and --augment on apply to images, not to --data text")
