"""HF Trainer: how far gradient accumulation ends from the unaccumulated run.

A tiny random GPT-2 (two blocks, width 32, 16 positions, vocabulary 64, no dropout; built
from a config, nothing downloaded) trained for ``--steps`` steps through
``transformers.Trainer`` at batch 16, and at batch 8 with ``gradient_accumulation_steps=2``
(the same samples in the same order); the largest absolute weight difference between the
two is written per optimizer: AdamW (the Trainer's own) and ``KFACOptimizer.for_model``
with its defaults, with ``moment_eps=1e-3``, with ``method="eigen"``, and with the
position embedding left out (``skip_layers``), alone and with ``moment_eps=1e-3``: the
position embedding's G is one sample's (``T`` rows, rank below its width), so the null space
of its eigenbasis is an arbitrary choice in which Adam's per-coordinate normalisation acts.

    PYTHONPATH=src python benchmarks/probes/trainer_accumulation.py --label after \\
        --out benchmarks/results/trainer_accumulation.json
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

import torch
import transformers

from dkfac import KFACOptimizer

VARIANTS = {
    "adamw": None,
    "kfac_default": {},
    "kfac_eps_1e-3": {"moment_eps": 1e-3},
    "kfac_eigen": {"method": "eigen"},
    "kfac_skip_wpe": {"skip_layers": ("wpe",)},
    "kfac_skip_wpe_eps_1e-3": {"skip_layers": ("wpe",), "moment_eps": 1e-3},
}


def _model() -> torch.nn.Module:
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


def _run(options: dict | None, batch: int, accumulation: int, steps: int) -> list[torch.Tensor]:
    model = _model()
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation, max_steps=steps, learning_rate=3e-3,
            lr_scheduler_type="constant", report_to=[], save_strategy="no",
            logging_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
        )  # fmt: skip
        optimizers = (None, None)
        if options is not None:
            optimizers = (KFACOptimizer.for_model(model, lr=3e-3, **options), None)
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=_Tokens(), optimizers=optimizers
        )
        trainer.train()
    return [p.detach().clone() for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="name of this measurement")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    logging.getLogger("dkfac").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    gaps = {}
    for name, options in VARIANTS.items():
        full = _run(options, 16, 1, args.steps)
        accumulated = _run(options, 8, 2, args.steps)
        gaps[name] = max((a - b).abs().max().item() for a, b in zip(full, accumulated, strict=True))
        print(args.label, name, f"{gaps[name]:.3g}", flush=True)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results[args.label] = {"steps": args.steps, "max_weight_difference": gaps}
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
