"""K-FAC recipes in ``dkfac bench``: a ``dkfac train --config`` file as one K-FAC peer.

A recipe is a TOML file whose top-level keys are flags of ``dkfac train`` (dashes or
underscores), the very file ``dkfac train --config FILE`` reads. :func:`load_recipe` reads it
exactly as ``dkfac train`` does (every value through the flag's own parsing and checks; a key
that is absent takes ``dkfac train``'s default) and turns it into one K-FAC
:class:`~dkfac.bench.peers.OptimizerSpec` named after the file's stem (``digits-cnn.toml``
-> ``digits-cnn``):

* ``optimizer``: ``kfac`` (also where the key is absent: ``dkfac train``'s default,
  ``dkfac``, is no recipe) -> ``inner=sgd``; ``kfac-adam`` -> ``inner=adamw``. ``dkfac train``'s
  ``kfac-adam`` is ``torch.optim.Adam(betas=(momentum, 0.999), weight_decay)``, whose decay
  is an L2 term in the gradient; the benchmark runs ``torch.optim.AdamW`` with the same betas
  and the recipe's ``weight_decay`` as AdamW's decoupled decay (the benchmark's AdamW peer is
  AdamW too). Any other optimizer is refused: a recipe is a K-FAC recipe.
* ``lr``: the grid ``lr * 2**k``, ``k = -(n // 2) .. n - 1 - (n // 2)``, where ``n`` is the
  size of the other optimizers' grids (:func:`recipe_grid`): the recipe's own lr is in it and
  no optimizer sweeps more rates than another. With ``--no-sweep``, just ``[lr]``.
* ``momentum`` -> ``inner_momentum`` (SGD's momentum, or AdamW's beta1); ``weight_decay`` ->
  ``inner_weight_decay``; ``nesterov`` must be false (the benchmark's inner SGD has none).
* every field of :class:`~dkfac.KFACConfig` (but ``lr``, ``seed`` and ``accumulation_steps``,
  which are training flags) -> a preconditioner option of the type its flag parses to
  (booleans stay booleans, ``"none"`` is ``None``, dtypes are torch dtypes).
* ``schedule`` must be ``constant`` (the benchmarks run a constant lr; ``dkfac train``'s
  default, ``cosine``, applies when the key is absent, so a recipe says ``constant``), and a
  ``<field>_schedule`` key is refused: the benchmarks run constant options.
* :data:`TASK_KEYS` (data, model and their sizes, batch size, budget, seeds, evaluation,
  logging, devices, files) are set by the benchmark itself: ignored, but kept in the
  spec's ``recipe`` record (path, every value of the file, the ignored keys) in the JSON.
* :data:`INERT_KEYS` change training in ways the benchmark does not implement (label
  smoothing, mixup, autocast, ...): allowed only at ``dkfac train``'s default.
* any other key is refused, with the list of what is allowed.

Every error is a ``ValueError`` with a one-line message that names the file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dkfac.app.cli import build_parser, parse_args
from dkfac.app.runconfig import ConfigError, load_config_file
from dkfac.bench.peers import OptimizerSpec
from dkfac.config import KFACConfig

__all__ = [
    "INERT_KEYS",
    "OPTIMIZER_KEYS",
    "RECIPE_OPTIMIZERS",
    "TASK_KEYS",
    "Recipe",
    "kfac_keys",
    "load_recipe",
    "recipe_grid",
]

RECIPE_OPTIMIZERS = {"kfac": "sgd", "kfac-adam": "adamw"}
"""``dkfac train --optimizer`` of a recipe -> the benchmark's inner optimizer."""

OPTIMIZER_KEYS = frozenset({"optimizer", "lr", "momentum", "weight_decay", "nesterov", "schedule"})
"""Training flags a recipe sets for the optimizer."""

TASK_KEYS = frozenset(
    {"model", "data", "data_dir", "augment", "synthetic_samples", "image_size", "in_channels"}
    | {"num_classes", "batch_norm", "layers", "width", "heads", "seq_len", "text_path"}
    | {"text_bytes", "text_glob", "epochs", "steps", "batch_size", "seed", "warmup_epochs"}
    | {"milestones", "gamma", "power"}  # shapes of step / poly schedules; the lr is constant
    | {"out", "overwrite", "resume", "checkpoint_every", "checkpoint_epochs", "eval_every"}
    | {"log_every", "target_accuracy", "stop_at_target", "device", "threads", "dist_timeout"}
)
"""Training flags that the benchmark sets itself: ignored (and recorded)."""

INERT_KEYS = frozenset(
    {"accumulation_steps", "label_smoothing", "mixup", "mixup_mode", "weight_rescale"}
    | {"momentum_scale_with_lr", "amp", "lrs", "muon_adamw_lr", "parallel", "shard_size"}
)
"""Training flags the benchmark does not implement: allowed at ``dkfac train``'s default only."""


def kfac_keys() -> frozenset[str]:
    """The recipe keys that are preconditioner options: fields of :class:`KFACConfig` that
    are not training flags of another kind (``lr``, ``seed``, ``accumulation_steps``)."""
    fields = {f.name for f in dataclasses.fields(KFACConfig)}
    return frozenset(fields - OPTIMIZER_KEYS - TASK_KEYS - INERT_KEYS)


@dataclass(frozen=True)
class Recipe:
    """A recipe file read by :func:`load_recipe`.

    Attributes:
        path: The file.
        name: Its stem: the optimizer's name in tables and JSON.
        lr: The recipe's learning rate.
        options: The spec's options: ``inner``, ``inner_momentum``, ``inner_weight_decay``
            and the preconditioner options of the file.
        values: Every value of the file as written (keys with underscores).
        ignored: The keys of the file that the benchmark sets itself.
    """

    path: str
    name: str
    lr: float
    options: dict[str, Any]
    values: dict[str, Any] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)

    def spec(self, grid_size: int, sweep: bool = True) -> OptimizerSpec:
        """The K-FAC spec: the grid of :func:`recipe_grid` (``[lr]`` without a sweep)."""
        lrs = recipe_grid(self.lr, grid_size) if sweep else [self.lr]
        record = {"path": self.path, "values": self.values, "ignored": self.ignored}
        return OptimizerSpec(self.name, "kfac", lrs, dict(self.options), recipe=record)


def recipe_grid(lr: float, size: int) -> list[float]:
    """``lr * 2**k`` for ``k = -(size // 2) .. size - 1 - size // 2``: ``size`` rates, ``lr``
    among them (in the middle, or just above it for an even size).

    Raises:
        ValueError: If ``size < 1``.
    """
    if size < 1:
        raise ValueError(f"a learning-rate grid needs at least one rate, got size {size}")
    return [lr * 2.0**k for k in range(-(size // 2), size - size // 2)]


def load_recipe(path: str | Path) -> Recipe:
    """Reads a recipe file (see the module docstring for every rule).

    Raises:
        ValueError: For a file that ``dkfac train --config`` refuses, or that breaks a rule.
    """
    where = f"--recipe {path}"
    try:
        values = load_config_file(path)
    except ConfigError as error:
        raise ValueError(f"{where}: {error}") from None
    _check_keys(values, where)
    args = _train_args(Path(path), where, "optimizer" not in values)
    inner = _inner_optimizer(args, values, where)
    options: dict[str, Any] = {
        "inner": inner,
        "inner_momentum": args.momentum,
        "inner_weight_decay": args.weight_decay,
    }
    for key in sorted(kfac_keys() & set(values)):
        value = getattr(args, key)
        options[key] = tuple(value) if isinstance(value, list) else value
    ignored = sorted(TASK_KEYS & set(values))
    return Recipe(str(path), Path(path).stem, float(args.lr), options, values, ignored)


def _check_keys(values: dict[str, Any], where: str) -> None:
    """Refuses schedules and keys outside every category."""
    if schedules := sorted(k for k in values if k.endswith("_schedule")):
        raise ValueError(
            f"{where}: {', '.join(schedules)}: the benchmarks run constant options; drop the "
            "piecewise schedule"
        )
    allowed = OPTIMIZER_KEYS | kfac_keys() | TASK_KEYS | INERT_KEYS
    if unknown := sorted(set(values) - allowed):
        raise ValueError(
            f"{where}: {', '.join(unknown)} cannot be in a recipe; allowed: "
            f"{', '.join(sorted(OPTIMIZER_KEYS))}; K-FAC options {', '.join(sorted(kfac_keys()))}; "
            f"at dkfac train's default only: {', '.join(sorted(INERT_KEYS))}; set by the "
            f"benchmark (ignored): {', '.join(sorted(TASK_KEYS))}"
        )


def _train_args(path: Path, where: str, as_kfac: bool) -> argparse.Namespace:
    """The file parsed by ``dkfac train --config`` (its one-line error, if any), with
    ``--optimizer kfac`` where ``as_kfac`` (a file that names no optimizer)."""
    stream = io.StringIO()
    kfac = ["--optimizer", "kfac"] if as_kfac else []
    try:
        with contextlib.redirect_stderr(stream):
            return parse_args(["train", *kfac, "--config", str(path)])
    except SystemExit:
        lines = stream.getvalue().strip().splitlines() or ["dkfac train refused it"]
        message = lines[-1].partition("error: ")[2] or lines[-1]
        raise ValueError(f"{where}: dkfac train --config: {message}") from None


def _inner_optimizer(args: argparse.Namespace, values: dict[str, Any], where: str) -> str:
    """The inner optimizer of the recipe; checks the optimizer keys and the inert ones."""
    if args.optimizer not in RECIPE_OPTIMIZERS:
        raise ValueError(
            f"{where}: optimizer {args.optimizer!r} is not K-FAC; a recipe's optimizer is "
            f"{' or '.join(RECIPE_OPTIMIZERS)}"
        )
    if args.schedule != "constant":
        absent = "" if "schedule" in values else " (dkfac train's default: the file sets none)"
        raise ValueError(
            f"{where}: schedule is {args.schedule!r}{absent}; the benchmarks run a constant lr: "
            'set schedule = "constant"'
        )
    if args.nesterov:
        raise ValueError(f"{where}: nesterov = true: the benchmark's inner SGD has no Nesterov")
    _, subs = build_parser()
    for key in sorted(INERT_KEYS & set(values)):
        default = subs["train"].get_default(key)
        if getattr(args, key) != default:
            raise ValueError(
                f"{where}: {key} = {values[key]!r}: the benchmarks do not implement it; "
                f"drop it or give dkfac train's default ({default!r})"
            )
    return RECIPE_OPTIMIZERS[args.optimizer]
