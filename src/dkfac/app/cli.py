"""Command line of the training program: ``dkfac train | compare | bench | plan``.

Only argument parsing and validation live here; :mod:`dkfac.app.trainer` runs the training.
Every error in the input (unknown flag, wrong type, out-of-range value, contradictory
options, bad config file) ends with one message and exit code 2 before any training starts.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from dkfac.app.cli_checks import OPTIMIZERS, check_args, default_lr
from dkfac.app.data import DATASETS
from dkfac.app.gpt import add_gpt_arguments
from dkfac.app.idle_flags import warn_idle_flags
from dkfac.app.models import ModelError, check_model_name, model_names
from dkfac.app.parallel import add_parallel_arguments
from dkfac.app.runconfig import (
    ConfigError,
    add_kfac_arguments,
    config_file_tokens,
    format_value,
    load_config_file,
    optional,
)
from dkfac.app.schedules import SCHEDULES
from dkfac.app.text import DEFAULT_GLOB, DEFAULT_TEXT_BYTES

AMP_MODES = ("none", "bf16", "fp16")
MIXUP_MODES = ("standard", "running")
EXTERNAL = {"bench": "dkfac.bench", "plan": "dkfac.app.plan"}
COMMANDS = {
    "train": "train one model",
    "compare": "train with several optimizers, one report",
    "bench": "benchmarks: step cost, time to accuracy, ...",
    "plan": "predict distributed strategies' costs, pick one",
}

EPILOG = """\
Config file: TOML, one `key = value` per flag (dashes or underscores), e.g. `lr = 0.05`;
flags on the command line override it. Every run saves its resolved config.toml.
K-FAC schedules: --damping-schedule "1e-2@0,1e-3@5" means 0.01 from epoch 0, 0.001 from
epoch 5 on (the same for every --<kfac-field>-schedule).
Distributed: torchrun --nproc-per-node N -m dkfac train ... (same flags; --batch-size is
the global batch of one optimizer step).
"""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the epilog's layout and ends every option's help with its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            not action.option_strings
            or action.default is argparse.SUPPRESS
            or "%(default)" in text
            or "(default:" in text
        ):
            return text
        return f"{text} (default: {format_value(action.default)})".lstrip()


class _OneConfig(argparse.Action):
    """``--config``, given at most once: argparse would keep the last of two files and
    read nothing of the first."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        earlier = getattr(namespace, self.dest, None)
        if isinstance(earlier, str):  # not the default, nor given_flags' marker
            parser.error(
                f"--config is given twice ({earlier!r}, {values!r}): give one file (flags on "
                "the command line override it)"
            )
        setattr(namespace, self.dest, values)


def _model_name(text: str) -> str:
    """argparse ``type`` of ``--model``: a built-in name or an importable factory."""
    try:
        return check_model_name(text)
    except ModelError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_text_arguments(g: argparse._ArgumentGroup) -> None:
    """The language-model flags: GPT sizes and the byte-level text."""
    add_gpt_arguments(g)
    g.add_argument(
        "--text-path",
        type=optional(str),
        default=None,
        help="--data text: a text file or a folder (default: none = the Python standard "
        "library's source folder)",
    )
    g.add_argument(
        "--text-bytes", type=int, default=DEFAULT_TEXT_BYTES, help="--data text: bytes read"
    )
    g.add_argument(
        "--text-glob", default=DEFAULT_GLOB, help="--data text: file names read from a folder"
    )


def _add_training_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``train`` and ``compare``."""
    opt = optional
    g = p.add_argument_group("data and model")
    g.add_argument(
        "--model",
        type=_model_name,
        default="cnn",
        metavar="NAME|PKG.MOD:FACTORY",
        help=f"{', '.join(model_names())}, or a callable returning an nn.Module",
    )
    g.add_argument("--data", choices=DATASETS, default="digits", help="dataset (default: digits)")
    g.add_argument(
        "--data-dir", type=opt(str), default=None, help="CIFAR archive (.tar.gz) or its folder"
    )
    g.add_argument(
        "--augment",
        choices=("auto", "on", "off"),
        default="auto",
        help="random crop + flip (auto: on for CIFAR)",
    )
    g.add_argument("--synthetic-samples", type=int, default=1024, help="synthetic train images")
    g.add_argument("--image-size", type=int, default=32, help="synthetic image size")
    g.add_argument("--in-channels", type=int, default=3, help="synthetic channels")
    g.add_argument("--num-classes", type=int, default=10, help="synthetic classes")
    g.add_argument(
        "--batch-norm",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="cnn only: BatchNorm after each convolution",
    )
    _add_text_arguments(g)

    g = p.add_argument_group("optimisation")
    g.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="dkfac",
        help="dkfac = KFACOptimizer.for_model, the recommended default (the K-FAC flags given, "
        "on the command line or in --config, change it); kfac = K-FAC + SGD, kfac-adam "
        "= K-FAC + Adam; muon = torch.optim.Muon on the hidden weights, AdamW on the rest "
        "(default: dkfac)",
    )
    g.add_argument("--epochs", type=int, default=15, help="epochs (default: 15)")
    g.add_argument("--steps", type=opt(int), default=None, help="stop after this many steps")
    g.add_argument(
        "--batch-size", type=int, default=64, help="global samples per optimizer step (default: 64)"
    )
    g.add_argument(
        "--lr", type=float, default=None, help=f"base learning rate (default: {default_lr()})"
    )
    g.add_argument(
        "--lrs",
        nargs="*",
        default=[],
        metavar="OPTIMIZER=LR",
        help="learning rates per optimizer, e.g. adamw=0.003 muon=0.05: the one named by "
        "--optimizer (each of --optimizers in compare) replaces --lr",
    )
    g.add_argument(
        "--muon-adamw-lr",
        type=float,
        default=1e-3,
        help="--optimizer muon: the lr of AdamW on the parameters Muon leaves (default: 1e-3)",
    )
    g.add_argument("--momentum", type=float, default=0.9, help="SGD momentum / Adam beta1")
    g.add_argument(
        "--nesterov", action=argparse.BooleanOptionalAction, default=False, help="Nesterov momentum"
    )
    g.add_argument("--weight-decay", type=float, default=5e-4, help="(default: 5e-4)")
    g.add_argument("--schedule", choices=SCHEDULES, default="cosine", help="LR schedule")
    g.add_argument("--warmup-epochs", type=float, default=0.0, help="linear LR warm-up")
    g.add_argument(
        "--milestones", type=float, nargs="*", default=[], help="epochs of the step schedule"
    )
    g.add_argument("--gamma", type=float, default=0.1, help="step-schedule decay factor")
    g.add_argument("--power", type=float, default=2.0, help="poly-schedule exponent")
    g.add_argument("--label-smoothing", type=float, default=0.0, help="cross-entropy smoothing")
    g.add_argument("--mixup", type=float, default=0.0, help="mixup Beta(a, a) parameter; 0 = off")
    g.add_argument(
        "--mixup-mode",
        choices=MIXUP_MODES,
        default="standard",
        help="standard: mix with a permuted batch; running: with the previous mixed batch",
    )
    g.add_argument(
        "--weight-rescale",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="rescale conv/linear weights to norm sqrt(2*d_out) after each step (no decay)",
    )
    g.add_argument(
        "--momentum-scale-with-lr",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="momentum = --momentum * lr / base lr at every step",
    )
    g.add_argument(
        "--accumulation-steps", type=int, default=1, help="micro-batches per optimizer step"
    )
    g.add_argument("--amp", choices=AMP_MODES, default="none", help="autocast precision")
    g.add_argument("--seed", type=int, default=0, help="seed of the model, data order and K-FAC")

    g = p.add_argument_group("run")
    g.add_argument(
        "--config", action=_OneConfig, default=None, help="TOML file of flag values (one)"
    )
    g.add_argument("--out", type=opt(str), default=None, help="run folder (runs/<timestamp>)")
    g.add_argument(
        "--overwrite",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="start afresh in an --out folder that holds an earlier run (deletes its checkpoints)",
    )
    g.add_argument(
        "--resume",
        type=opt(str),
        default=None,
        help="checkpoint file, run folder (its newest good checkpoint), or 'auto' (--out's)",
    )
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="steps between checkpoints (0: only at the end)",
    )
    g.add_argument("--checkpoint-epochs", type=int, default=0, help="epochs between checkpoints")
    g.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="steps between evaluations (0: at the end of each epoch)",
    )
    g.add_argument("--log-every", type=int, default=10, help="steps between metric lines")
    g.add_argument(
        "--target-accuracy",
        type=opt(float),
        default=None,
        help="report steps and seconds to reach this test accuracy",
    )
    g.add_argument(
        "--stop-at-target",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="stop once --target-accuracy is reached",
    )
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--threads", type=opt(int), default=None, help="torch CPU threads")
    g.add_argument(
        "--dist-timeout",
        type=float,
        default=300.0,
        help="seconds a rank waits in a collective before the job fails (default: 300)",
    )
    add_parallel_arguments(g)
    reserved = {a.dest for a in p._actions}
    add_kfac_arguments(p, reserved)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and its ``train`` / ``compare`` sub-parsers."""
    parser = argparse.ArgumentParser(
        prog="dkfac",
        description="Distributed K-FAC training program.",
        epilog="Each command has its own --help, e.g. dkfac train --help.",
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    kinds = HelpFormatter
    train = sub.add_parser("train", help=COMMANDS["train"], epilog=EPILOG, formatter_class=kinds)
    _add_training_arguments(train)
    compare = sub.add_parser(
        "compare",
        help=COMMANDS["compare"],
        epilog=EPILOG,
        formatter_class=kinds,
    )
    _add_training_arguments(compare)
    compare.add_argument(
        "--optimizers",
        default="dkfac,adamw,muon",
        help=f"comma-separated, from {', '.join(OPTIMIZERS)} (default: dkfac,adamw,muon)",
    )
    for name in EXTERNAL:  # listed for --help; main() hands them to their own programs
        sub.add_parser(name, help=COMMANDS[name], add_help=False)
    return parser, {"train": train, "compare": compare}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parses ``train`` / ``compare`` arguments, merging a ``--config`` file under the flags.

    Raises:
        SystemExit: With code 2 and a message on any bad input.
    """
    parser, subs = build_parser()
    argv = list(argv)
    typed = list(argv)  # as given, before the config file's values are merged in
    first, _ = parser.parse_known_args(argv)
    if first.command is None:
        parser.print_usage(sys.stderr)
        parser.exit(2, "dkfac: error: give a command: train, compare, bench or plan\n")
    if first.command in EXTERNAL:
        parser.error(f"dkfac {first.command} is its own program: run it through main()")
    sub = subs[first.command]
    if first.config is not None:
        try:
            values = load_config_file(first.config)
            tokens = config_file_tokens(values, sub, first.config)
        except ConfigError as err:
            sub.error(str(err))
        at = argv.index(first.command) + 1
        argv = [*argv[:at], *tokens, *argv[at:]]
    args = parser.parse_args(argv)
    args.given = given_flags(sub, argv[argv.index(first.command) + 1 :])
    if any(a == "--lr" or a.startswith("--lr=") for a in typed):
        # --lr on the command line wins over the config file's --lrs entry for this run.
        args.lrs = [e for e in args.lrs if not str(e).startswith(f"{args.optimizer}=")]
    check_args(args, sub)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, said once
        warn_idle_flags(args, sub)
    return args


def given_flags(sub: argparse.ArgumentParser, tokens: Sequence[str]) -> tuple[str, ...]:
    """The destinations ``tokens`` (a command's flags, a config file's included) set, so
    that a value given equal to a default is told from one left at it: argparse fills
    only the destinations a namespace lacks, so every one starts at a marker here."""
    unset = object()
    dests = {a.dest for a in sub._actions if a.dest != argparse.SUPPRESS}
    probe = argparse.Namespace(**dict.fromkeys(dests, unset))
    sub.parse_known_args(list(tokens), probe)
    return tuple(sorted(d for d, v in vars(probe).items() if v is not unset))


def _external(command: str, argv: list[str]) -> int:
    """Runs ``dkfac bench`` / ``dkfac plan`` from their own modules (imported lazily)."""
    try:
        module = importlib.import_module(EXTERNAL[command])
        entry = module.main
    except (ImportError, AttributeError) as err:
        print(f"dkfac {command}: not available in this installation ({err})", file=sys.stderr)
        return 2
    return int(entry(argv) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dkfac`` console script and ``python -m dkfac``."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in EXTERNAL:
        return _external(args_list[0], args_list[1:])
    args = parse_args(args_list)
    from dkfac.app.trainer import run_command

    return run_command(args)
