"""Flags given to ``dkfac train`` or ``compare`` that the run will not read.

A flag such as ``--milestones`` without ``--schedule step``, or ``--damping`` with
``--optimizer sgd``, is valid on its own, so the parser takes it; but the run it was given
to never reads it, which is most often a typo in another flag. It is not refused (one config
file may serve several optimizers and schedules), but it is named:
:func:`idle_flags` lists them and :func:`warn_idle_flags` logs one warning for each.

A flag counts when the command line or the ``--config`` file sets it (``args.given``,
:func:`dkfac.app.cli.given_flags`) to a value other than its default, so a run repeated from
its saved ``config.toml`` (every option written) names only what was named the first time;
in ``compare`` a flag is idle only when no optimizer of the run reads it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable

from dkfac.app.session import KFAC_RUNS
from dkfac.config import KFACConfig

__all__ = ["idle_flags", "kfac_dests", "warn_idle_flags"]

_log = logging.getLogger(__name__)

_Rule = tuple[Callable[[argparse.Namespace, frozenset[str]], bool], str]

RULES: dict[str, _Rule] = {
    "milestones": (lambda a, o: a.schedule == "step", "the run's --schedule is not step"),
    "gamma": (lambda a, o: a.schedule == "step", "the run's --schedule is not step"),
    "power": (lambda a, o: a.schedule == "poly", "the run's --schedule is not poly"),
    "muon_adamw_lr": (lambda a, o: "muon" in o, "no optimizer of the run is muon"),
    "nesterov": (lambda a, o: bool(o & {"sgd", "kfac"}), "no optimizer of the run is SGD"),
    "momentum": (
        lambda a, o: bool(o - {"dkfac"}) or a.momentum_scale_with_lr,
        "dkfac reads no momentum (without --momentum-scale-with-lr)",
    ),
    "data_dir": (lambda a, o: a.data in ("cifar10", "cifar100"), "--data is not CIFAR"),
    "synthetic_samples": (lambda a, o: a.data == "synthetic", "--data is not synthetic"),
    "image_size": (lambda a, o: a.data == "synthetic", "--data is not synthetic"),
    "in_channels": (lambda a, o: a.data == "synthetic", "--data is not synthetic"),
    "num_classes": (lambda a, o: a.data == "synthetic", "--data is not synthetic"),
    "text_path": (lambda a, o: a.data == "text", "--data is not text"),
    "text_bytes": (lambda a, o: a.data == "text", "--data is not text"),
    "text_glob": (lambda a, o: a.data == "text", "--data is not text"),
    "seq_len": (lambda a, o: a.data == "text", "--data is not text"),
    "layers": (lambda a, o: a.model == "gpt", "--model is not gpt"),
    "width": (lambda a, o: a.model == "gpt", "--model is not gpt"),
    "heads": (lambda a, o: a.model == "gpt", "--model is not gpt"),
}
"""Flag destination -> (whether the run reads it, given the namespace and the run's
optimizers; why not, when it does not)."""


def kfac_dests(parser: argparse.ArgumentParser) -> set[str]:
    """The destinations of the K-FAC flags of ``parser`` (each spelled also ``--kfac-...``)
    and of their schedules; a :class:`KFACConfig` field filled from a training flag
    (``--lr``, ``--seed``, ``--accumulation-steps``, ``--strategy``, ...) is not among
    them: the run reads those whatever its optimizer."""
    fields = {f.name for f in dataclasses.fields(KFACConfig)}
    own = {
        a.dest
        for a in parser._actions
        if a.dest in fields and any(o.startswith("--kfac-") for o in a.option_strings)
    }
    return own | {f"{d}_schedule" for d in own}


def _optimizers(args: argparse.Namespace) -> frozenset[str]:
    if args.command == "compare":
        return frozenset(n for n in str(args.optimizers).split(",") if n)
    return frozenset({str(args.optimizer)})


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def idle_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """One message for each flag given (``args.given``) off its default that the run will
    not read.

    Args:
        args: A namespace of :func:`dkfac.app.cli.parse_args` (``train`` or ``compare``).
        parser: The command's parser (its defaults, and which flags are K-FAC's).

    Returns:
        The messages, in the order of the flags' names; empty where every flag given is read.
    """
    defaults = {a.dest: a.default for a in parser._actions}
    given = [d for d in getattr(args, "given", ()) if getattr(args, d) != defaults.get(d)]
    optimizers = _optimizers(args)
    messages = []
    kfac = kfac_dests(parser)
    for dest in sorted(given):
        if dest in kfac and not optimizers & set(KFAC_RUNS):
            messages.append(
                f"{_flag(dest)} is a K-FAC option and no optimizer of the run is "
                f"{', '.join(sorted(KFAC_RUNS))}: it is not read"
            )
        elif dest in RULES and not RULES[dest][0](args, optimizers):
            messages.append(f"{_flag(dest)} is given but {RULES[dest][1]}: it is not read")
    return messages


def warn_idle_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Logs :func:`idle_flags`'s messages as warnings (one each)."""
    for message in idle_flags(args, parser):
        _log.warning("dkfac %s: %s", args.command, message)
