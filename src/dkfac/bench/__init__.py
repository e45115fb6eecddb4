"""``dkfac bench``: the benchmark programs.

Each sub-benchmark is a module of this package with a ``main(argv) -> int``; it writes a JSON
file to ``benchmarks/results/`` (machine, torch version, command, every repeat) and prints a
summary table. Sub-benchmarks are imported lazily so that one with a missing optional piece
does not break the others.

    python -m dkfac.bench step --model resnet20 --batch-size 128
    python -m dkfac.bench dispatches --model resnet20 --launch-bound   # a GPU's launches
    python -m dkfac.bench tta --seeds 3   # SGD, AdamW, Muon, SOAP, K-FAC (dkfac.bench.peers)
    python -m dkfac.bench autoencoder
    python -m dkfac.bench lm --seconds 90   # byte-level GPT: AdamW, Muon, SOAP, K-FAC
    python -m dkfac.bench tta --recipe benchmarks/recipes/digits-cnn.toml   # a K-FAC recipe
    python -m dkfac.bench comm      # and: memory
    python -m dkfac.bench suite --threads 1   # six families, the default vs peers
    python -m dkfac.bench soak --steps 10000 --method eigen
    python -m dkfac.bench phases muon adamw benchmarks/recipes/gpt-text.toml   # step phases
    python -m dkfac.bench conv-paths   # and: fsdp-memory, fsdp-step, shard-exchange, ...
    python -m dkfac.bench report    # BENCHMARKS.md and its plots from benchmarks/results/
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

__all__ = ["SUBCOMMANDS", "main"]

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "step": ("dkfac.bench.step", "per-step time of SGD vs K-FAC configurations, phases"),
    "dispatches": ("dkfac.bench.dispatches", "tensor operations one step dispatches, by kind"),
    "tta": ("dkfac.bench.tta", "digits: time and steps to a test accuracy, K-FAC and peers"),
    "autoencoder": ("dkfac.bench.autoencoder", "digits autoencoder: loss vs time, K-FAC and peers"),
    "lm": ("dkfac.bench.lm", "byte-level GPT: validation loss vs time, K-FAC and peers"),
    "lm-interleaved": ("dkfac.bench.interleave", "bench lm with the optimizers' steps interleaved"),
    "paired": ("dkfac.bench.paired", "paired per-seed loss differences of two optimizers"),
    "solvers": ("dkfac.bench.solvers", "eigen / cholesky / smw inverse time vs width, batch"),
    "comm": ("dkfac.bench.comm", "ledger bytes per strategy vs the cost model"),
    "memory": ("dkfac.bench.comm:main_memory", "memory per rank per strategy vs the cost model"),
    "suite": ("dkfac.bench.suite", "the default vs AdamW, Muon, SOAP on six model families"),
    "soak": ("dkfac.bench.soak", "thousands of K-FAC steps on gloo ranks: resident memory"),
    "conv-paths": (
        "dkfac.bench.conv_paths",
        "the conv input factor's exact paths: time, auto's regret",
    ),
    "precision": (
        "dkfac.bench.precision",
        "polar factors and rotations in bf16 or float32 by shape: the CPU's rule",
    ),
    "phases": (
        "dkfac.bench.phases",
        "language model step: forward, backward, optimizer step apart",
    ),
    "fsdp-memory": (
        "dkfac.bench.fsdp_memory",
        "K-FAC under FSDP2 on gloo ranks: memory, bytes, step time",
    ),
    "fsdp-step": (
        "dkfac.bench.fsdp_step",
        "K-FAC's step time against AdamW's under FSDP2, interleaved, medians of seeds",
    ),
    "shard-exchange": (
        "dkfac.bench.shard_exchange",
        "K-FAC under FSDP2: exact vs local mode vs serial, digits and lm",
    ),
    "accumulation": (
        "dkfac.bench.accumulation",
        "HF Trainer: gradient accumulation against one large batch",
    ),
    "report": ("dkfac.bench.report", "BENCHMARKS.md and its plots from benchmarks/results/"),
}
"""Sub-benchmark name -> (``module`` or ``module:function``, one-line description)."""


def _usage() -> str:
    lines = ["usage: dkfac bench {" + ",".join(SUBCOMMANDS) + "} [options]", ""]
    lines += [f"  {name:<12} {desc}" for name, (_, desc) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatches ``dkfac bench <name> ...`` to ``dkfac.bench.<name>.main``.

    Args:
        argv: Arguments after ``bench`` (default: ``sys.argv[1:]``).

    Returns:
        The sub-benchmark's exit status; 2 for an unknown or missing sub-benchmark, or one
        whose module is not available in this installation.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        choices = ", ".join(SUBCOMMANDS)
        print(
            f"dkfac bench: error: unknown benchmark {name!r}; choose from {choices}",
            file=sys.stderr,
        )
        return 2
    module_name, _, function = SUBCOMMANDS[name][0].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        print(f"dkfac bench: {name!r} is not available in this build ({err})", file=sys.stderr)
        return 2
    return int(getattr(module, function or "main")(rest))
