"""``dkfac bench fsdp-step``: K-FAC's step time against AdamW's, both under FSDP2, side by side.

For each world size, one spawned gloo process group (``--threads`` torch threads per rank)
trains the byte-level GPT of ``dkfac bench fsdp-memory`` (``fully_shard`` on each block,
then the root) with AdamW and with ``KFACOptimizer.for_model`` at each pair of factor /
inverse intervals, every configuration on its own model, interleaved: one step of each in
turn on the same batch, so a slow minute slows them all alike. A step's time is the
slowest rank's (zero_grad, forward, backward, optimizer step, between barriers). Per seed
and configuration: the mean of ``--steps`` steps after ``--warmup`` (``--steps`` a multiple
of the largest inverse interval amortises the refreshes exactly), forward+backward and the
optimizer step apart; the ratio to AdamW's mean. Over ``--seeds`` seeds: medians. Also per
rank: K-FAC's ledger bytes per step by kind and FSDP2's own bytes per step (predicted by
:func:`dkfac.costmodel.sharded.fsdp_bytes`: not on the ledger), K-FAC's memory
(``pre.memory_usage()``) and the parameter and optimizer-state shards. With ``--profile N``,
N more steps of the K-FAC configuration with the largest intervals run under
``torch.profiler`` on every rank, and rank 0's CPU milliseconds per step of each phase
(forward+backward, the step's ``dkfac.*`` labels) are recorded.

    dkfac bench fsdp-step --worlds 2 4 --seeds 3 --steps 100 --threads 1 --profile 20 \\
        --out benchmarks/results/fsdp_step_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dkfac import KFACOptimizer
from dkfac.bench.arguments import BenchParser
from dkfac.bench.common import command_line, format_table, machine_info, median, write_result
from dkfac.bench.fsdp_memory import (
    INTERVALS,
    PER_RANK,
    SEQ,
    SIZES,
    VOCAB,
    local_bytes,
    sharded_gpt,
)
from dkfac.bench.gloo_ranks import run_ranks
from dkfac.costmodel import extract_layers
from dkfac.costmodel.sharded import fsdp_bytes

__all__ = ["main", "run_world"]


def _optimizer(model: torch.nn.Module, key: str, strategy: str) -> Any:
    if key == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    factor, inverse = (int(v) for v in key.removeprefix("kfac@").split(","))
    return KFACOptimizer.for_model(
        model,
        strategy=strategy,
        factor_update_interval=factor,
        inverse_update_interval=inverse,
    )


def _slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds``."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _step(model: torch.nn.Module, opt: Any, ids: torch.Tensor) -> tuple[float, float]:
    """One training step; this rank's forward+backward and optimizer seconds."""
    start = time.perf_counter()
    opt.zero_grad()
    logits = model(ids[:, :-1])
    F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
    middle = time.perf_counter()
    opt.step()
    return middle - start, time.perf_counter() - middle


def _seed(rank: int, seed: int, keys: list[str], args: dict[str, Any]) -> dict[str, Any]:
    """Every configuration of one seed, interleaved; each one's timings and state."""
    models = {key: sharded_gpt() for key in keys}
    opts = {key: _optimizer(model, key, args["strategy"]) for key, model in models.items()}
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    times: dict[str, list[tuple[float, float]]] = {key: [] for key in keys}
    for step in range(args["warmup"] + args["steps"]):
        ids = torch.randint(0, VOCAB, (PER_RANK, SEQ + 1), generator=gen)
        for key in keys:
            dist.barrier()
            fwd_bwd, opt_s = _step(models[key], opts[key], ids)
            if step >= args["warmup"]:
                times[key].append((_slowest(fwd_bwd + opt_s), _slowest(opt_s)))
    out: dict[str, Any] = {}
    for key in keys:
        model, opt = models[key], opts[key]
        total = [t for t, _ in times[key]]
        record: dict[str, Any] = {
            "step_seconds": statistics.fmean(total),
            "optimizer_seconds": statistics.fmean(o for _, o in times[key]),
            "param_shard_bytes": local_bytes(model.parameters()),
        }
        inner = opt.inner if isinstance(opt, KFACOptimizer) else opt
        record["optimizer_state_bytes"] = local_bytes(
            t
            for state in inner.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        if isinstance(opt, KFACOptimizer):
            pre = opt.preconditioner
            record["kfac_memory"] = pre.memory_usage()
            stats = pre.comm_stats()["total"]
            record["ledger_bytes_per_step"] = {
                k: v / (args["warmup"] + args["steps"]) for k, v in stats.items()
            }
        out[key] = record
    if args["profile"] and keys[1:]:
        out["profile"] = _profile(models[keys[-1]], opts[keys[-1]], gen, args["profile"])
    return out


def _profile(model: torch.nn.Module, opt: Any, gen: torch.Generator, steps: int) -> dict:
    """CPU milliseconds per step of forward+backward and of each ``dkfac.*`` phase."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            ids = torch.randint(0, VOCAB, (PER_RANK, SEQ + 1), generator=gen)
            dist.barrier()
            with record_function("bench.forward_backward"):
                opt.zero_grad()
                logits = model(ids[:, :-1])
                F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
            with record_function("bench.optimizer_step"):
                opt.step()
    phases = {
        event.key: event.cpu_time_total / 1e3 / steps
        for event in prof.key_averages()
        if event.key.startswith(("bench.", "dkfac."))
    }
    return dict(sorted(phases.items(), key=lambda kv: -kv[1]))


def _record(rank: int, world: int, args: dict[str, Any]) -> dict[Any, Any]:
    """Every seed's record on this rank (inside :func:`~dkfac.bench.gloo_ranks.run_ranks`'s
    process group)."""
    del world
    torch.set_num_threads(args["threads"])
    keys = ["adamw", *(f"kfac@{f},{i}" for f, i in args["intervals"])]
    return {seed: _seed(rank, seed, keys, args) for seed in args["seeds"]}


def summarise(per_rank: list[dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Medians over seeds of rank 0's timings (the slowest rank's, agreed), the ratio of each
    K-FAC configuration's mean step to AdamW's, and rank 0's bytes and memory."""
    seeds = per_rank[0]
    keys = [k for k in next(iter(seeds.values())) if k != "profile"]
    summary: dict[str, Any] = {}
    for key in keys:
        step = [seeds[s][key]["step_seconds"] for s in seeds]
        ratio = [seeds[s][key]["step_seconds"] / seeds[s]["adamw"]["step_seconds"] for s in seeds]
        first = next(iter(seeds.values()))[key]
        summary[key] = {
            "step_ms": 1e3 * median(step),
            "optimizer_ms": 1e3 * median([seeds[s][key]["optimizer_seconds"] for s in seeds]),
            "ratio_to_adamw": median(ratio),
            "ratios": ratio,
            "ledger_bytes_per_step": first.get("ledger_bytes_per_step", {}),
            "kfac_memory": first.get("kfac_memory", {}),
            "param_shard_bytes": max(r[next(iter(r))][key]["param_shard_bytes"] for r in per_rank),
            "optimizer_state_bytes": max(
                r[next(iter(r))][key]["optimizer_state_bytes"] for r in per_rank
            ),
        }
    return summary


def run_world(world: int, args: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Every seed and configuration on ``world`` ranks: per-rank records and the summary."""
    per_rank = run_ranks(_record, world, (args,), timeout)
    spec = extract_layers(sharded_model_for_spec())
    return {
        "per_rank": per_rank,
        "summary": summarise(per_rank),
        "fsdp_bytes_per_step": fsdp_bytes(spec, world),
    }


def sharded_model_for_spec() -> torch.nn.Module:
    """The benchmark's GPT unsharded (for the cost model's layer shapes)."""
    from dkfac.app.gpt import GPT

    return GPT(
        vocab_size=VOCAB,
        context=SEQ,
        layers=SIZES["layers"],
        width=SIZES["width"],
        heads=SIZES["heads"],
    )


def _parser() -> argparse.ArgumentParser:
    p = BenchParser(prog="dkfac bench fsdp-step", description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="ranks per run")
    p.add_argument("--seeds", type=int, default=3, help="seeds (medians over them)")
    p.add_argument("--first-seed", type=int, default=0, help="the first seed")
    p.add_argument("--steps", type=int, default=100, help="measured steps per seed")
    p.add_argument("--warmup", type=int, default=5, help="steps not measured")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument(
        "--intervals",
        nargs="+",
        default=[f"{f},{i}" for f, i in INTERVALS],
        help="K-FAC factor,inverse intervals",
    )
    p.add_argument(
        "--strategy",
        default="mem-opt",
        choices=("replicated", "kaisa", "mem-opt", "dp"),
        help="K-FAC strategy",
    )
    p.add_argument("--profile", type=int, default=0, help="steps profiled (0: none)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per world size")
    p.add_argument("--out", type=Path, required=True, help="the JSON file written")
    return p


def _intervals(parser: argparse.ArgumentParser, items: list[str]) -> list[tuple[int, int]]:
    pairs = []
    for item in items:
        try:
            factor, inverse = (int(v) for v in item.split(","))
        except ValueError:
            parser.error(f"--intervals takes FACTOR,INVERSE pairs of integers, got {item!r}")
        if factor < 1 or inverse < factor or inverse % factor:
            parser.error(
                f"--intervals {item}: need 1 <= factor <= inverse, inverse a multiple of factor"
            )
        pairs.append((factor, inverse))
    return pairs


def main(argv: Sequence[str] | None = None) -> int:
    """Runs every world size, prints the summary table, writes ``--out``; 1 if ranks failed."""
    parser = _parser()
    args = parser.parse_args(argv)
    counts = {"--seeds": args.seeds, "--steps": args.steps, "--threads": args.threads}
    if min(args.worlds) < 2:
        parser.error(f"--worlds must be 2 ranks or more, got {args.worlds}")
    for flag, value in counts.items():
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.warmup < 0 or args.profile < 0 or not args.timeout > 0:
        parser.error("--warmup and --profile must be >= 0 and --timeout > 0")
    if args.out.suffix != ".json":
        parser.error(f"--out must name a .json file, got {str(args.out)!r}")
    settings = {
        "seeds": list(range(args.first_seed, args.first_seed + args.seeds)),
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": args.threads,
        "intervals": _intervals(parser, args.intervals),
        "strategy": args.strategy,
        "profile": args.profile,
    }
    report: dict[str, Any] = {
        "machine": machine_info(),
        "model": {**SIZES, "seq_len": SEQ, "vocab": VOCAB, "per_rank_batch": PER_RANK},
        "settings": settings,
        "worlds": {},
    }
    rows = []
    for world in args.worlds:
        try:
            result = run_world(world, settings, args.timeout)
        except RuntimeError as error:
            print(f"dkfac bench fsdp-step: {error}")
            return 1
        report["worlds"][str(world)] = result
        for key, s in result["summary"].items():
            ledger = sum(s["ledger_bytes_per_step"].values())
            kfac = sum(s["kfac_memory"].values())
            rows.append(
                [world, key, f"{s['step_ms']:.1f}", f"{s['ratio_to_adamw']:.2f}",
                 f"{ledger / 1e6:.2f}", f"{kfac / 1e6:.2f}"]
            )  # fmt: skip
    headers = ["ranks", "optimizer", "step ms", "x AdamW", "ledger MB/step", "K-FAC MB/rank"]
    print(format_table(headers, rows))
    for world, result in report["worlds"].items():
        profile = result["per_rank"][0][settings["seeds"][0]].get("profile")
        if profile:
            print(f"{world} ranks, phases (ms per step, rank 0): {json.dumps(profile)}")
    command = command_line("dkfac bench fsdp-step", None if argv is None else list(argv))
    write_result(args.out.stem, report, args.out.parent, command)
    return 0
