"""``dkfac bench accumulation``: how far HF Trainer's gradient accumulation ends from the
unaccumulated run.

A tiny random GPT-2 (two blocks, width 32, 16 positions, vocabulary 64, no dropout; built
from a config, nothing downloaded) trained for ``--steps`` steps through
``transformers.Trainer`` at batch 16, and at batch 8 with ``gradient_accumulation_steps=2``
(the same samples in the same order); the largest absolute weight difference between the
two is written per optimizer (``--variants``, default all): AdamW (the Trainer's own) and
``KFACOptimizer.for_model`` with its defaults, with ``moment_eps=1e-3``, with
``method="eigen"``, and with the position embedding left out (``skip_layers``), alone and
with ``moment_eps=1e-3``: the position embedding's G is one sample's (``T`` rows, rank below
its width), the case :mod:`dkfac.solvers.null_space` is for. The result is stored under
``--label`` in ``--out`` (other labels in the file are kept).

    dkfac bench accumulation --label after --out benchmarks/results/trainer_accumulation.json
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dkfac import KFACOptimizer
from dkfac.bench.arguments import BenchParser
from dkfac.bench.common import command_line, machine_info

__all__ = ["VARIANTS", "main", "weight_gap"]

VARIANTS: dict[str, dict[str, Any] | None] = {
    "adamw": None,
    "kfac_default": {},
    "kfac_eps_1e-3": {"moment_eps": 1e-3},
    "kfac_eigen": {"method": "eigen"},
    "kfac_skip_wpe": {"skip_layers": ("wpe",)},
    "kfac_skip_wpe_eps_1e-3": {"skip_layers": ("wpe",), "moment_eps": 1e-3},
}
"""Variant name -> ``KFACOptimizer.for_model`` options (``None``: the Trainer's AdamW)."""


def _model() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (128, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(
    options: dict[str, Any] | None, batch: int, accumulation: int, steps: int
) -> list[torch.Tensor]:
    """The weights after ``steps`` Trainer steps of ``batch × accumulation`` samples."""
    import transformers

    model = _model()
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation, max_steps=steps, learning_rate=3e-3,
            lr_scheduler_type="constant", report_to=[], save_strategy="no",
            logging_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
        )  # fmt: skip
        optimizers: tuple[Any, Any] = (None, None)
        if options is not None:
            optimizers = (KFACOptimizer.for_model(model, lr=3e-3, **options), None)
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=_Tokens(), optimizers=optimizers
        )
        trainer.train()
    return [p.detach().clone() for p in model.parameters()]


def weight_gap(options: dict[str, Any] | None, steps: int) -> float:
    """The largest weight difference between batch 16 and batch 8 accumulated twice."""
    full = train(options, 16, 1, steps)
    accumulated = train(options, 8, 2, steps)
    return max((a - b).abs().max().item() for a, b in zip(full, accumulated, strict=True))


def _parser() -> argparse.ArgumentParser:
    parser = BenchParser(prog="dkfac bench accumulation", description=__doc__.split("\n")[0])
    parser.add_argument("--label", required=True, help="name of this measurement in --out")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), metavar="NAME"
    )
    parser.add_argument("--out", type=Path, required=True, help="the JSON file (labels kept)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Measures each variant's gap, prints it, stores it under ``--label`` in ``--out``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps < 1 or not args.label.strip():
        parser.error(
            f"--steps must be >= 1 and --label not empty, got {args.steps}, {args.label!r}"
        )
    if args.out.suffix != ".json":
        parser.error(f"--out must name a .json file, got {str(args.out)!r}")
    try:
        results = json.loads(args.out.read_text()) if args.out.exists() else {}
    except (OSError, ValueError) as error:
        parser.error(f"--out {str(args.out)!r} is not a readable JSON file: {error}")
    if not isinstance(results, dict):
        parser.error(f"--out {str(args.out)!r} does not hold a JSON object of labels")
    try:
        import transformers
    except ImportError:
        parser.error("dkfac bench accumulation needs transformers (pip install transformers)")
    torch.set_num_threads(1)
    gaps = {}
    # Quiet while it runs, and put back after (a caller's logging is left as it was).
    verbosity, ours = transformers.logging.get_verbosity(), logging.getLogger("dkfac")
    level = ours.level
    transformers.logging.set_verbosity_error()
    ours.setLevel(logging.ERROR)
    try:
        for name in args.variants:
            gaps[name] = weight_gap(VARIANTS[name], args.steps)
            print(args.label, name, f"{gaps[name]:.3g}", flush=True)
    finally:
        transformers.logging.set_verbosity(verbosity)
        ours.setLevel(level)
    results[args.label] = {
        "command": command_line("dkfac bench accumulation", None if argv is None else list(argv)),
        "machine": machine_info(),
        "steps": args.steps,
        "max_weight_difference": gaps,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0
