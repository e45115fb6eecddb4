"""The default (``KFACOptimizer.for_model(model, lr=lr)``, nothing else set) against AdamW on
kinds of model and training loops no recipe was written for, as an unseen user tries it.

Each kind learns the labels of a teacher of its own class (another seed, argmax of its
outputs centred over the pool: a task the model can fit, every class present) on a pool of
512 fixed inputs, batches drawn by a generator of the seed. Both optimizers run
:data:`STEPS` steps at each of three learning rates (:data:`LRS`, the same for both,
weight decay 0) on each seed; the figure is the mean training loss of the last 5 steps,
median over the seeds, and the best lr of each. A rough check (is the default about as
good as AdamW on this kind, does it train at all), not a time-to-target race.

Kinds: blocks under ``torch.utils.checkpoint`` (reentrant), a ``channels_last`` CNN with
non-square, dilated, strided, reflect- and same-padded convolutions, a 1-D audio-like CNN,
a whole model in float64 and in bfloat16, an ``nn.Transformer`` sequence-to-sequence model,
attention whose keys and values are narrower than its queries, a model with a main and an
auxiliary head (losses summed), one with data-dependent control flow and stochastic depth;
and loops: ``clip_grad_norm_`` before the step, ``zero_grad(set_to_none=False)``,
``CosineAnnealingLR``, ``OneCycleLR`` with its defaults, validation passes between steps,
and a batch of one sample every tenth step. ``OneCycleLR`` cycles the momentum: Adam's
``β₁`` where the groups hold ``"betas"`` (``for_model``'s do: its first moment's), else SGD's
``momentum``; a third arm, ``kfac_sgd_momentum``, removes the ``"betas"`` so that it cycles
the inner SGD's momentum on top of the first moment, as it did before the groups held them.

    PYTHONPATH=src python benchmarks/probes/model_kinds.py --threads 1 \\
        --out benchmarks/results/model_kinds.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dkfac import KFACOptimizer

STEPS = 40
SEEDS = (0, 1, 2)
LRS = (3e-3, 1e-2, 3e-2)
POOL = 512


class Residual(nn.Module):
    """Pre-norm MLP blocks of width 32 (optionally under ``checkpoint``), BatchNorm-free."""

    def __init__(self, checkpointed: bool = False, drop: bool = False) -> None:
        super().__init__()
        self.checkpointed, self.drop = checkpointed, drop
        self.inp, self.head = nn.Linear(10, 32), nn.Linear(32, 4)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
            for _ in range(3)
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block in self.blocks:
            if self.drop and self.training and h[0, 0] > 0:  # data-dependent depth
                continue
            h = h + (checkpoint(block, h, use_reentrant=True) if self.checkpointed else block(h))
        return self.head(h)


class OddConvs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv2d(3, 8, (1, 3), padding="same"), nn.ReLU(),
            nn.Conv2d(8, 8, (3, 1), dilation=2, padding="same", padding_mode="reflect"),
            nn.ReLU(), nn.Conv2d(8, 16, (3, 2), stride=2, padding=(1, 0)), nn.BatchNorm2d(16),
            nn.ReLU(), nn.Conv2d(16, 16, 3, stride=2, padding=1, padding_mode="replicate"),
            nn.ReLU(), nn.Flatten(), nn.Linear(16 * 3 * 3, 4),
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        return self.convs(x)


def audio() -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(2, 8, 5, stride=2, padding=2), nn.ReLU(),
        nn.Conv1d(8, 8, 3, dilation=2, padding="same", padding_mode="reflect"), nn.ReLU(),
        nn.Conv1d(8, 16, 4, stride=3, dilation=2), nn.ReLU(), nn.AdaptiveAvgPool1d(1),
        nn.Flatten(), nn.Linear(16, 4),
    )  # fmt: skip


class Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(11, 32)
        self.core = nn.Transformer(32, 4, 1, 1, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 11)

    def forward(self, src: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(src.shape[1])
        a = self.tokens(src)
        return self.head(self.core(a, a, tgt_mask=mask, tgt_is_causal=True))


class NarrowKeys(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(4, 16) * 0.1)
        self.keys = nn.Linear(6, 10)
        self.attention = nn.MultiheadAttention(16, 2, kdim=10, vdim=6, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        queries = self.queries.expand(x.shape[0], -1, -1)
        return self.head(self.attention(queries, self.keys(x), x)[0].mean(1))


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid = nn.Linear(10, 32), nn.Linear(32, 32)
        self.main, self.aux = nn.Linear(32, 4), nn.Linear(32, 2)

    def forward(self, x: Tensor) -> Tensor:
        early = F.gelu(self.inp(x))
        return torch.cat([self.main(F.gelu(self.mid(early))), self.aux(early)], -1)


def _inputs(kind: str, gen: torch.Generator) -> Tensor:
    shapes = {"odd_convs": (POOL, 3, 12, 12), "audio": (POOL, 2, 48), "narrow_keys": (POOL, 6, 6)}
    if kind == "seq2seq":
        return torch.randint(0, 11, (POOL, 8), generator=gen)
    return torch.randn(*shapes.get(kind, (POOL, 10)), generator=gen)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "checkpointed": lambda: Residual(checkpointed=True),
    "odd_convs": OddConvs,
    "audio": audio,
    "float64": lambda: Residual().double(),
    "bfloat16": lambda: Residual().bfloat16(),
    "seq2seq": Seq2Seq,
    "narrow_keys": NarrowKeys,
    "two_heads": TwoHeads,
    "stochastic_depth": lambda: Residual(drop=True),
}
LOOPS = ("clip", "zero_grad_false", "cosine", "one_cycle", "validation", "batch_of_one")
"""Training loops, each on the plain residual MLP."""


def _loss(kind: str, out: Tensor, y: Tensor) -> Tensor:
    if kind == "two_heads":
        return F.cross_entropy(out[:, :4], y[:, 0]) + 0.5 * F.cross_entropy(out[:, 4:], y[:, 1])
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


def _targets(kind: str, teacher: nn.Module, x: Tensor) -> Tensor:
    with torch.no_grad():
        out = teacher.eval()(x).float()
        out = out - out.flatten(0, -2).mean(0)  # logits centred over the pool: every class
    if kind == "two_heads":
        return torch.stack([out[:, :4].argmax(-1), out[:, 4:].argmax(-1)], -1)
    return out.argmax(-1)


def run(kind: str, arm: str, lr: float, seed: int) -> float:
    """The mean training loss of the last 5 of :data:`STEPS` steps."""
    model_kind = kind if kind in MODELS else "plain"
    make = MODELS.get(kind, Residual)
    torch.manual_seed(1000 + seed)
    teacher = make()
    x = _inputs(model_kind, torch.Generator().manual_seed(seed))
    dtype = next(teacher.parameters()).dtype
    x = x if x.dtype == torch.long else x.to(dtype)
    y = _targets(kind, teacher, x)
    torch.manual_seed(seed)
    model = make()
    if kind == "odd_convs":
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        x = x.contiguous(memory_format=torch.channels_last)
    opt: torch.optim.Optimizer
    if arm == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    else:
        opt = KFACOptimizer.for_model(model, lr=lr)
    if arm == "kfac_sgd_momentum":  # no "betas": a scheduler cycles SGD's momentum on top
        del opt.defaults["betas"]
        for group in opt.param_groups:
            del group["betas"]
    scheduler: Any = None
    if kind == "cosine":
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, STEPS)
    elif kind == "one_cycle":
        scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=STEPS)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(STEPS):
        size = 1 if kind == "batch_of_one" and step % 10 == 9 else 64
        rows = torch.randint(0, POOL, (size,), generator=gen)
        model.train()
        opt.zero_grad(set_to_none=kind != "zero_grad_false")
        loss = _loss(kind, model(x[rows]), y[rows])
        loss.backward()
        if kind == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        if scheduler is not None:
            scheduler.step()
        if kind == "validation" and step % 5 == 0:
            model.eval()
            with torch.no_grad():
                model(x[:128])
        losses.append(float(loss))
    return statistics.mean(losses[-5:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kinds", nargs="*", default=[*MODELS, *LOOPS])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {}
    for kind in args.kinds:
        arms: dict[str, Any] = {}
        for arm in ("kfac", "adamw", *(("kfac_sgd_momentum",) if kind == "one_cycle" else ())):
            medians = {
                f"{lr:g}": statistics.median(run(kind, arm, lr, seed) for seed in SEEDS)
                for lr in LRS
            }
            best = min(medians, key=lambda k: medians[k])
            arms[arm] = {"by_lr": medians, "best_lr": best, "best": medians[best]}
        results[kind] = arms
        shown = "  ".join(f"{a} {r['best']:.4f} (lr {r['best_lr']})" for a, r in arms.items())
        print(f"{kind:>18}: {shown}", flush=True)
    if args.out is not None:
        record = {
            "command": "PYTHONPATH=src python benchmarks/probes/model_kinds.py "
            f"--threads {args.threads} --out {args.out}",
            "steps": STEPS,
            "seeds": list(SEEDS),
            "figure": "mean training loss of the last 5 steps, median over seeds",
            "results": results,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
