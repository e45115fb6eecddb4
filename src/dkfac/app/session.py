"""One training session: data, model, DDP, optimizer, schedule, K-FAC; one step; evaluation.

:func:`build_session` turns parsed options into a :class:`Session` on this rank;
:func:`train_step` runs one optimizer step (micro-batches, augmentation, mixup, autocast,
gradient scaling, the K-FAC step, the large-batch recipe of :mod:`dkfac.app.recipe`);
:func:`evaluate` computes the test metrics summed over ranks.
:mod:`dkfac.app.trainer` drives them.

Randomness that a step draws (crop/flip offsets, mixup) comes from generators seeded by
``(seed, rank, step)``, so a run resumed from a checkpoint sees the same batches and
augmentations as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dkfac.app.data import DataError, Splits, load_dataset, random_crop_flip, shard_indices
from dkfac.app.gpt import gpt_options
from dkfac.app.models import ModelError, SmallCNN, build_model
from dkfac.app.muon import MuonAdamW
from dkfac.app.parallel import wrap_model
from dkfac.app.recipe import RunningMixup, mixing_weight, rescale_weights, scale_momentum
from dkfac.app.runconfig import dkfac_defaults, kfac_config_from_args
from dkfac.app.schedules import make_lr_lambda
from dkfac.config import KFACConfig
from dkfac.optimizer import KFACOptimizer
from dkfac.preconditioner import KFACPreconditioner

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
EVAL_ROWS = 512  # samples per evaluation forward pass
EVAL_TOKENS = 2**15  # target tokens per evaluation forward pass of a sequence model

KFAC_RUNS = ("kfac", "kfac-adam", "dkfac")
"""The optimizers of the program that run a K-FAC preconditioner (read ``--strategy``)."""


class UsageError(ValueError):
    """Options that cannot work together, found once the data and world size are known."""


def world_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation failure (CUDA or CPU) rather than a bug."""
    if isinstance(err, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(err, RuntimeError) and "can't allocate memory" in str(err)


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """Sums numbers over ranks (identity on one process)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if world_info()[1] > 1:
        dist.all_reduce(t)
    return [float(v) for v in t.tolist()]


def weights_finite(run: Session) -> bool:
    """Whether every parameter is finite on every rank (a collective with several ranks)."""
    bad = sum(int(not bool(torch.isfinite(local(p)).all())) for p in run.bare.parameters())
    return all_sum([float(bad)], run.device)[0] == 0


def local(tensor: Tensor) -> Tensor:
    """This rank's part of a sharded tensor (DTensor), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def step_generator(seed: int, rank: int, step: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device if device.type == "cuda" else "cpu")
    gen.manual_seed((seed * 1_000_003 + rank * 7_919 + step) % (2**63))
    return gen


@dataclasses.dataclass
class Session:
    """Everything the loop needs, built once by :func:`build_session`."""

    args: argparse.Namespace
    data: Splits
    model: nn.Module  # maybe DDP-wrapped
    bare: nn.Module
    optimizer: torch.optim.Optimizer
    preconditioner: KFACPreconditioner | None
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: Any
    device: torch.device
    rank: int
    world: int
    micro_batch: int
    steps_per_epoch: int
    total_steps: int
    reconstruct: bool
    running_mixup: RunningMixup | None = None

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded (``--parallel fsdp`` or ``hsdp``)."""
        return isinstance(self.bare, FSDPModule)


def build_session(args: argparse.Namespace, device: torch.device) -> Session:
    """The session of parsed options on this rank.

    Raises:
        UsageError: For options that do not fit the data, the model, the world size or the
            memory of this machine.
    """
    try:
        return _build_session(args, device)
    except Exception as err:
        if is_out_of_memory(err):
            raise UsageError(
                "not enough memory for this run's data and model "
                f"({str(err).splitlines()[0][:200]}); reduce --num-classes, --image-size, "
                "--in-channels, --synthetic-samples or --batch-size"
            ) from None
        raise


def _build_session(args: argparse.Namespace, device: torch.device) -> Session:
    rank, world = world_info()
    torch.manual_seed(args.seed)
    try:
        data = load_dataset(
            args.data,
            args.data_dir,
            seed=args.seed,
            num_samples=args.synthetic_samples,
            in_channels=args.in_channels,
            image_size=args.image_size,
            num_classes=args.num_classes,
            text_path=getattr(args, "text_path", None),
            text_bytes=getattr(args, "text_bytes", None),
            text_glob=getattr(args, "text_glob", None),
            seq_len=getattr(args, "seq_len", 128),
        )
    except DataError as err:
        raise UsageError(str(err)) from None
    per_rank, rest = divmod(args.batch_size, world * args.accumulation_steps)
    if per_rank < 1 or rest:
        raise UsageError(
            f"--batch-size {args.batch_size} must be a multiple of world size ({world}) x "
            f"--accumulation-steps ({args.accumulation_steps})"
        )
    shard = len(shard_indices(len(data.y_train), rank, world, shuffle=False))
    steps_per_epoch = shard // (per_rank * args.accumulation_steps)
    if steps_per_epoch < 1:
        raise UsageError(
            f"--batch-size {args.batch_size} exceeds the {len(data.y_train)} "
            f"training samples of {args.data}"
        )
    total = args.epochs * steps_per_epoch
    total = total if args.steps is None else min(total, args.steps)
    if args.amp == "fp16" and device.type != "cuda":
        raise UsageError("--amp fp16 needs a CUDA device (use --amp bf16 on CPU)")
    if getattr(args, "batch_norm", False):  # the cli allows it for the cnn only
        bare: nn.Module = SmallCNN(
            data.in_channels, data.num_classes, data.image_size, batch_norm=True
        ).to(device)
    else:
        try:
            bare = _build_model(args, data).to(device)
        except UsageError:
            raise
        except ValueError as err:  # a shape this model cannot take
            raise UsageError(f"--model {args.model}: {err}") from None
    if not any(p.requires_grad for p in bare.parameters()):
        raise UsageError(f"--model {args.model}: the model has no trainable parameters")
    parallel = getattr(args, "parallel", "ddp")
    try:
        model = wrap_model(
            bare,
            parallel,
            world=world,
            device=device,
            shard_size=getattr(args, "shard_size", None),
            # spngd averages the gradients itself (no DDP): a K-FAC run's choice only
            strategy=getattr(args, "strategy", None) if args.optimizer in KFAC_RUNS else None,
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    scaler = torch.amp.GradScaler("cuda") if args.amp == "fp16" else None
    opt: torch.optim.Optimizer
    pre = None
    if args.optimizer == "dkfac":
        opt = _default_kfac(args, model, scaler, steps_per_epoch)
        pre = opt.preconditioner
    elif args.optimizer == "muon":
        if scaler is not None:
            raise UsageError("--optimizer muon does not run under --amp fp16 (use bf16)")
        try:
            opt = MuonAdamW(
                bare,
                args.lr,
                adamw_lr=args.muon_adamw_lr,
                momentum=args.momentum,
                weight_decay=args.weight_decay,
            )
        except ValueError as err:  # a model without hidden matrices
            raise UsageError(f"--optimizer muon: {err}") from None
    elif args.optimizer in ("sgd", "kfac"):
        opt = torch.optim.SGD(
            bare.parameters(),
            lr=args.lr,
            momentum=args.momentum,
            nesterov=args.nesterov,
            weight_decay=args.weight_decay,
        )
    else:
        kind = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.Adam
        opt = kind(
            bare.parameters(),
            lr=args.lr,
            betas=(args.momentum, 0.999),
            weight_decay=args.weight_decay,
        )
    lam = make_lr_lambda(
        schedule=args.schedule,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        warmup_epochs=args.warmup_epochs,
        milestones=args.milestones,
        gamma=args.gamma,
        power=args.power,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    if getattr(args, "momentum_scale_with_lr", False):
        scale_momentum(opt, args.momentum)
    if args.optimizer.startswith("kfac"):
        config = kfac_config_from_args(args, steps_per_epoch)
        try:
            pre = KFACPreconditioner(model, config=config, grad_scaler=scaler)
        except (TypeError, ValueError) as err:  # options that do not fit this model / world
            raise UsageError(f"K-FAC options: {err}") from None
        opt = KFACOptimizer(opt, pre)
    run = Session(
        args,
        data,
        model,
        bare,
        opt,
        pre,
        scheduler,
        scaler,
        device,
        rank,
        world,
        per_rank,
        steps_per_epoch,
        total,
        args.model == "autoencoder",
    )
    if getattr(args, "mixup_mode", "standard") == "running":
        run.running_mixup = RunningMixup(data.num_classes)
    return run


def _build_model(args: argparse.Namespace, data: Splits) -> nn.Module:
    """The model of ``--model`` for ``data``: built-in, GPT with its sizes, or a factory's."""
    options: dict[str, int] = {}
    if args.model == "gpt":
        options = gpt_options(args)
    elif ":" in args.model and data.name == "text":
        options = {"seq_len": data.image_size}
    try:
        return build_model(
            args.model,
            in_channels=data.in_channels,
            image_size=data.image_size,
            num_classes=data.num_classes,
            **options,
        )
    except ModelError as err:
        raise UsageError(str(err)) from None


def compute_loss(
    run: Session, out: Tensor, x: Tensor, y: Tensor, y2: Tensor | None, lam: float
) -> Tensor:
    out = out.float()
    if run.reconstruct:
        return 0.5 * (out - x.flatten(1).float()).pow(2).sum(1).mean()
    if out.dim() > 2:  # a sequence model: (N, T, classes) logits, (N, T) targets
        out, y = out.flatten(0, -2), y.flatten()
        y2 = None if y2 is None else y2.flatten()
    smooth = run.args.label_smoothing
    loss = F.cross_entropy(out, y, label_smoothing=smooth)
    if y2 is not None:
        loss = lam * loss + (1 - lam) * F.cross_entropy(out, y2, label_smoothing=smooth)
    return loss


def autocast(run: Session) -> Any:
    dtype = AMP_DTYPES.get(run.args.amp)
    return torch.autocast(run.device.type, dtype=dtype, enabled=dtype is not None)


def train_step(run: Session, indices: list[int], step: int) -> tuple[list[float], float, float]:
    """One optimizer step over this rank's ``indices``; returns sums, fwd/bwd and opt seconds."""
    args, k = run.args, int(run.args.accumulation_steps)
    gen = step_generator(args.seed, run.rank, step, run.device)
    mix = random.Random(args.seed * 1_000_003 + run.rank * 7_919 + step)
    sums = [0.0, 0.0, 0.0]  # loss x samples, correct, samples
    t0 = time.perf_counter()
    for i in range(k):
        idx = torch.tensor(indices[i * run.micro_batch : (i + 1) * run.micro_batch])
        x = run.data.x_train[idx].to(run.device, non_blocking=True)
        y = run.data.y_train[idx].to(run.device, non_blocking=True)
        if args.augment == "on" or (args.augment == "auto" and args.data.startswith("cifar")):
            x = random_crop_flip(x, generator=gen)
        y2, lam, soft = None, 1.0, None
        if run.running_mixup is not None:
            lam = mixing_weight(mix.betavariate(args.mixup, args.mixup))
            x, soft = run.running_mixup.mix(x, y, lam)
        elif args.mixup > 0:
            lam = mix.betavariate(args.mixup, args.mixup)
            perm = torch.randperm(len(y), generator=gen, device=gen.device).to(run.device)
            x, y2 = lam * x + (1 - lam) * x[perm], y[perm]
        if isinstance(run.model, FSDPModule):  # reduce-scatter on the last micro-batch only
            run.model.set_requires_gradient_sync(i == k - 1)
        sync = i == k - 1 or not isinstance(run.model, nn.parallel.DistributedDataParallel)
        ctx = contextlib.nullcontext() if sync else run.model.no_sync()  # type: ignore[operator]
        with ctx:
            with autocast(run):
                out = run.model(x)
            if soft is None:
                loss = compute_loss(run, out, x, y, y2, lam)
            else:
                loss = F.cross_entropy(out.float(), soft, label_smoothing=args.label_smoothing)
            pre = run.preconditioner
            if pre is not None and pre.config.fisher == "mc":
                pre.sample_fisher(out.float(), "mse" if run.reconstruct else "cross_entropy")
            scaled = loss / k
            (run.scaler.scale(scaled) if run.scaler is not None else scaled).backward()
        n = y.numel()  # samples, or tokens of a sequence model (loss and accuracy per token)
        sums[0] += float(loss.detach()) * n
        sums[2] += n
        if not run.reconstruct:
            sums[1] += float((out.detach().argmax(-1) == y).sum())
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    t1 = time.perf_counter()
    if run.scaler is not None:
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        run.optimizer.step()
    if getattr(args, "weight_rescale", False):
        rescale_weights(run.bare)
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    if getattr(args, "momentum_scale_with_lr", False):
        scale_momentum(run.optimizer, args.momentum)
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    return sums, t1 - t0, time.perf_counter() - t1


@torch.no_grad()
def evaluate(run: Session) -> tuple[float, float | None]:
    """Test loss and accuracy, each rank on its slice of the test set, summed over ranks.

    For a sequence model both are per token: the mean cross-entropy of every target token
    (nats per byte for ``--data text``) and the fraction of next tokens predicted.
    """
    run.bare.eval()
    x_all, y_all = run.data.x_test, run.data.y_test
    mine = torch.arange(run.rank, len(y_all), run.world)
    sums = [0.0, 0.0, 0.0]
    rows = EVAL_ROWS
    if y_all.dim() > 1 and len(y_all):  # sequences: about EVAL_TOKENS target tokens a chunk
        rows = max(1, EVAL_TOKENS // y_all[0].numel())
    pieces = [mine[start : start + rows] for start in range(0, len(mine), rows)]
    if run.sharded:  # every rank the same number of forwards (each all-gathers the weights)
        most = -(-len(y_all) // run.world)
        pieces = list(torch.tensor_split(mine, max(1, -(-most // rows))))
    for idx in pieces:
        x, y = x_all[idx].to(run.device), y_all[idx].to(run.device)
        with autocast(run):
            out = run.bare(x)
        sums[0] += float(compute_loss(run, out, x, y, None, 1.0)) * y.numel()
        sums[1] += float((out.argmax(-1) == y).sum()) if not run.reconstruct else 0.0
        sums[2] += y.numel()
    run.bare.train()
    loss, correct, count = all_sum(sums, run.device)
    return loss / max(count, 1), None if run.reconstruct else correct / max(count, 1)


def _default_kfac(
    args: argparse.Namespace,
    model: nn.Module,
    scaler: torch.amp.GradScaler | None,
    steps_per_epoch: int,
) -> KFACOptimizer:
    """``--optimizer dkfac``: :meth:`KFACOptimizer.for_model` at ``--lr``/``--weight-decay``.

    The K-FAC flags not given take ``for_model``'s defaults
    (:data:`~dkfac.optimizer.DEFAULT_OPTIONS`, those the method reads:
    :func:`~dkfac.app.runconfig.dkfac_defaults`); the ones given are passed on over them.
    """
    defaults = dkfac_defaults(args)
    config = kfac_config_from_args(args, steps_per_epoch, defaults=defaults)
    reference = KFACConfig(**defaults)
    # What was given or differs from for_model's own choice is passed: an option passed is
    # kept as it is, where for_model's overhead budget would otherwise choose it. The lr is
    # the inner SGD's, fed to the preconditioner by KFACOptimizer.
    given = set(getattr(args, "given", ()))
    options = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if f.name != "lr"
        and (f.name in given or getattr(config, f.name) != getattr(reference, f.name))
    }
    try:
        return KFACOptimizer.for_model(
            model, args.lr, weight_decay=args.weight_decay, grad_scaler=scaler, **options
        )
    except (TypeError, ValueError) as err:  # options that do not fit this model / world
        raise UsageError(f"K-FAC options: {err}") from None
