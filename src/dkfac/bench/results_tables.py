"""The tables and plots of BENCHMARKS.md's sections, each a function of their JSON files.

Each builder takes what it needs to know about the files (their names, row labels) and
returns a function of the section's payloads, as :class:`~dkfac.bench.page.Section` wants.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dkfac.bench.page import Payloads, Table


def f(value: float | None, digits: int = 2) -> str:
    """``value`` to ``digits`` decimals (``–`` for none or infinity)."""
    if value is None or value != value or value in (float("inf"), float("-inf")):
        return "–"
    return f"{value:.{digits}f}"


def against(value: float | None, limit: float) -> str:
    """``value`` checked against a target ``limit`` it must not exceed: in bold where it
    meets it, and with three decimals where two would round a miss onto the limit (1.004
    against 1 reads ``1.004``, not a met ``1.00``)."""
    if value is None or value != value or value in (float("inf"), float("-inf")):
        return "–"
    digits = 3 if value > limit and round(value, 2) <= limit else 2
    return f"**{f(value, digits)}**" if value <= limit else f(value, digits)


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


# ---- per-step cost (`dkfac bench step`) ------------------------------------------------


def amortised(payload: Mapping[str, Any], key: str, config: str = "exact") -> dict[str, Any]:
    return dict(payload["summary"]["configs"][config]["amortised"][key])


def cpu_step_table(runs: Mapping[str, Sequence[str]]) -> Callable[[Payloads], Table]:
    """Medians over repeated ``bench step`` runs of each method: × SGD and × AdamW."""

    def table(payloads: Payloads) -> Table:
        rows = []
        for method, names in runs.items():
            for key in ("10,100", "1,10", "1,1"):
                entries = [amortised(payloads[n], key) for n in names]
                by_adamw = [e["ratio_to_adamw"] for e in entries]
                rows.append(
                    [
                        f"`{method}`",
                        f"({key.replace(',', ', ')})",
                        f(_median([e["seconds"] for e in entries])),
                        f(_median([e["ratio_to_sgd"] for e in entries])),
                        f(_median(by_adamw)),
                        f"{f(min(by_adamw))}–{f(max(by_adamw))}",
                        str(len(names)),
                    ]
                )
        headers = ["method", "(factors, basis) every", "s/step", "× SGD", "× AdamW"]
        return Table([*headers, "× AdamW, runs", "runs"], rows)

    return table


def gpu_step_table(models: Mapping[str, str]) -> Callable[[Payloads], Table]:
    """One row per ``bench step`` file on a GPU: SGD's and AdamW's step, K-FAC's ratios."""

    def table(payloads: Payloads) -> Table:
        rows = []
        for label, name in models.items():
            summary = payloads[name]["summary"]
            plain = summary["configs"]["exact"]["kind_seconds"]["plain"]
            long, short = amortised(payloads[name], "10,100"), amortised(payloads[name], "1,10")
            rows.append(
                [
                    label,
                    str(payloads[name]["machine"]["date"])[:10],
                    f(summary["sgd_seconds"] * 1000, 1),
                    f(summary["adamw_seconds"] * 1000, 1),
                    f(plain / summary["adamw_seconds"]),
                    f"**{f(long['ratio_to_sgd'])}** / {f(long['ratio_to_adamw'])}",
                    f(short["ratio_to_sgd"]),
                ]
            )
        headers = ["model", "measured", "SGD ms", "AdamW ms", "plain step × AdamW"]
        return Table([*headers, "(10, 100) × SGD / × AdamW", "(1, 10) × SGD"], rows)

    return table


def lm_phases_table(name: str, labels: Mapping[str, str]) -> Callable[[Payloads], Table]:
    """The language model's step, phase by phase (``dkfac bench phases``), per optimizer."""

    def table(payloads: Payloads) -> Table:
        phases = payloads[name]["phases"]
        muon = phases["muon"]["total_ms"]
        rows = [
            [
                labels.get(key, key),
                f(p["fwd_ms"], 1),
                f(p["bwd_ms"], 1),
                f"{f(p['opt_ms'], 1)} ({f(p['opt_median_ms'], 1)})",
                f(p["total_ms"], 1),
                f(p["total_ms"] / muon),
            ]
            for key, p in phases.items()
        ]
        headers = ["optimizer", "forward ms", "backward ms", "step ms (median)", "total ms"]
        return Table([*headers, "÷ Muon"], rows)

    return table


def plot_step(name: str) -> Callable[[Payloads, str], None]:
    """``bench step``'s own phase plot of one file."""

    def draw(payloads: Payloads, path: str) -> None:
        from dkfac.bench.step_report import plot_breakdown

        plot_breakdown(payloads[name], path)

    return draw


# ---- optimizers side by side (`bench tta`, `bench autoencoder`, `bench lm`) --------------

RECIPES = {"digits-cnn", "digits-autoencoder", "gpt-text"}
NAMES = {
    "default": "`for_model` default",
    "digits-cnn": "**dkfac recipe**",
    "digits-autoencoder": "**dkfac recipe**",
    "gpt-text": "**dkfac recipe**",
}


def _recipe(summary: Mapping[str, Any]) -> Mapping[str, Any]:
    return next(v for k, v in summary.items() if k in RECIPES)


def peers_table(runs: Mapping[str, str], kind: str) -> Callable[[Payloads], Table]:
    """One row per optimizer of each run; times divided by the recipe's in the same run.

    Args:
        runs: Row label of a run -> its JSON file.
        kind: ``"tta"`` (steps and seconds to the test accuracy), ``"autoencoder"`` (exact
            steps and seconds to the training loss) or ``"lm"`` (loss at the time budget).
    """

    def table(payloads: Payloads) -> Table:
        rows = []
        for label, name in runs.items():
            summary = payloads[name]["summary"]
            mine = _recipe(summary)
            for key, entry in summary.items():
                row = [label, NAMES.get(key, key), f"{entry['lr']:g}"]
                if kind == "tta":
                    seconds, base = entry["median_seconds"], mine["median_seconds"]
                    row += [f(entry["median_steps"], 1), f(seconds), f(seconds / base)]
                    row.append(f"{entry['reached']}/{entry['runs']}")
                elif kind == "autoencoder":
                    seconds = entry["median_exact_seconds_to_target"]
                    base = mine["median_exact_seconds_to_target"]
                    row += [f(entry["median_exact_steps_to_target"], 0), f(seconds)]
                    row += [f(seconds / base), f(entry["median_final_loss"], 4)]
                else:
                    row += [f(entry["median_final_loss"], 3), f"{entry['median_steps']:g}"]
                    row.append(f(entry["seconds_per_step"] / mine["seconds_per_step"]))
                rows.append(row)
        headers = {
            "tta": ["steps", "seconds", "time ÷ recipe's", "reached"],
            "autoencoder": ["steps", "seconds", "time ÷ recipe's", "MSE at budget"],
            "lm": ["loss at budget", "steps", "step ÷ recipe's"],
        }[kind]
        return Table(["run", "optimizer", "lr", *headers], rows)

    return table


def paired_table(name: str) -> Callable[[Payloads], Table]:
    """``lm_paired.py``'s summary: the recipe's loss minus Muon's over paired seeds."""

    def table(payloads: Payloads) -> Table:
        rows = []
        for key, label in (("final", "at 60 s"), ("at_step", "at step 75")):
            s = payloads[name][key]
            rows.append(
                [
                    label,
                    str(s["pairs"]),
                    f(s["mean"], 3),
                    f(s["standard_error"], 3),
                    f(s["median"], 3),
                    f"{s['below_zero']}/{s['pairs']}",
                ]
            )
        headers = ["recipe − Muon", "seeds", "mean", "standard error", "median", "below Muon"]
        return Table(headers, rows)

    return table


def plot_with(module: str, name: str) -> Callable[[Payloads, str], None]:
    """The ``plot(payload, path)`` of ``dkfac.bench.<module>`` on one file."""

    def draw(payloads: Payloads, path: str) -> None:
        import importlib

        importlib.import_module(f"dkfac.bench.{module}").plot(payloads[name], path)

    return draw


# ---- distributed bytes and memory, soak -------------------------------------------------


def comm_table(name: str) -> Callable[[Payloads], Table]:
    """Per strategy and world size: bytes a rank sends, memory per rank, the model's match."""

    def table(payloads: Payloads) -> Table:
        groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for row in payloads[name]["rows"]:
            groups.setdefault((row["world_size"], row["strategy"]), []).append(row)
        rows = []
        for (world, strategy), ranks in groups.items():
            sent = [sum(r["ledger_full_step"].values()) for r in ranks]
            factor = [sum(r["ledger_factor_step"].values()) for r in ranks]
            memory = [sum(r["memory"].values()) for r in ranks]
            exact = all(
                r["ledger_full_step"] == r["predicted_full_step"]
                and r["ledger_factor_step"] == r["predicted_factor_step"]
                and r["memory"] == r["predicted_memory"]
                for r in ranks
            )
            rows.append(
                [
                    str(world),
                    f"`{strategy}`",
                    f"{max(sent):,}",
                    f"{max(factor):,}",
                    f"{min(memory):,}–{max(memory):,}",
                    "yes" if exact else "**no**",
                ]
            )
        headers = ["ranks", "strategy", "bytes sent, full step", "factor step"]
        return Table([*headers, "memory per rank (bytes)", "= cost model"], rows)

    return table


def plot_comm(name: str) -> Callable[[Payloads, str], None]:
    """Bars: bytes sent per full step and the largest memory per rank, at 4 ranks."""

    def draw(payloads: Payloads, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = [r for r in payloads[name]["rows"] if r["world_size"] == 4]
        strategies = list(dict.fromkeys(r["strategy"] for r in rows))
        sent = [
            max(sum(r["ledger_full_step"].values()) for r in rows if r["strategy"] == s)
            for s in strategies
        ]
        memory = [
            max(sum(r["memory"].values()) for r in rows if r["strategy"] == s) for s in strategies
        ]
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
        left.bar(strategies, [b / 1e3 for b in sent])
        left.set_ylabel("kB sent by a rank, full step")
        right.bar(strategies, [b / 1e3 for b in memory])
        right.set_ylabel("kB of K-FAC state, largest rank")
        for ax in (left, right):
            ax.tick_params(axis="x", labelrotation=30)
        fig.suptitle("small CNN on 4 gloo ranks: the ledger (equal to the cost model)")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    return draw


def soak_table(runs: Mapping[str, str]) -> Callable[[Payloads], Table]:
    """One row per method: steps, time, accuracy and resident memory of each rank."""

    def table(payloads: Payloads) -> Table:
        rows = []
        for method, name in runs.items():
            p = payloads[name]
            growth = p["growth_after_first_10pct"]
            rows.append(
                [
                    f"`{method}`",
                    str(p["config"]["steps"]),
                    f(p["wall_seconds"], 0),
                    f(p["test_accuracy"], 3),
                    " / ".join(f(g["rss_mib_at_10pct"], 0) for g in growth),
                    " / ".join(f(g["growth_mib"], 1) for g in growth),
                    " / ".join(f(g["slope_mib_per_1000_steps"], 2) for g in growth),
                ]
            )
        headers = ["method", "steps", "seconds", "test accuracy", "RSS MiB at 10% (ranks)"]
        return Table([*headers, "growth MiB after", "MiB per 1000 steps"], rows)

    return table


def plot_soak(runs: Mapping[str, str]) -> Callable[[Payloads, str], None]:
    """Resident memory of rank 0 against the step, one line per method."""

    def draw(payloads: Payloads, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for method, name in runs.items():
            samples = payloads[name]["samples"][0]
            ax.plot([s["step"] for s in samples], [s["rss_mib"] for s in samples], label=method)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("resident memory of rank 0 (MiB)")
        ax.set_ylim(bottom=0)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    return draw


STEP_LIMIT = 1.3
"""The default's step against AdamW's that the suite's table marks as met."""


def suite_table(name: str, earlier: str | None = None) -> Callable[[Payloads], Table]:
    """``dkfac bench suite`` (or a run of its protocol on other families): per family, the
    default's steps (both splits), its step and time against the best peer of the run, and
    SOAP's and shipped Muon's steps from ``earlier`` (a run of the same seeds with every
    peer; steps do not depend on the run; ``None``: no such column).
    The step (at most :data:`STEP_LIMIT` × AdamW's) and the time (at most the best
    peer's) are in bold where they meet their target (:func:`against`)."""

    def table(payloads: Payloads) -> Table:
        before = {
            task["task"]: task["summary"]["optimizers"]
            for task in (payloads[earlier]["tasks"] if earlier else [])
        }
        rows = []
        for task in payloads[name]["tasks"]:
            summary = task["summary"]
            mine, best = summary["optimizers"]["dkfac"], summary["best_peer"]
            peer = summary["optimizers"][best]
            old = before.get(task["task"], {})
            rows.append(
                [
                    task["task"],
                    f"{f(mine['median_steps'], 0)} / {f(mine['median_steps_split1'], 0)}",
                    against(mine["step_vs_adamw"], STEP_LIMIT),
                    f"{best}: {f(peer['median_steps'], 0)}, {f(peer['step_vs_adamw'])}",
                    against(mine["time_vs_best_peer"], 1.0),
                    " / ".join(
                        f(old[n]["median_steps"], 0) if n in old else "–" for n in ("soap", "muon")
                    ),
                ][: None if earlier else -1]
            )
        headers = [
            "family",
            "dkfac steps (split 0 / 1)",
            "dkfac step × AdamW",
            "best peer: steps, step × AdamW",
            "dkfac time ÷ best peer",
            "SOAP / Muon steps",
        ]
        return Table(headers[: None if earlier else -1], rows)

    return table


def plot_suite(name: str, task: str) -> Callable[[Payloads, str], None]:
    """The suite's plot of one task (:func:`dkfac.bench.suite_report.plot_task`)."""

    def plot(payloads: Payloads, path: str) -> None:
        from dkfac.bench.suite_report import plot_task

        record = next(t for t in payloads[name]["tasks"] if t["task"] == task)
        plot_task(record, path)

    return plot


def dispatch_table(runs: Mapping[str, str]) -> Callable[[Payloads], Table]:
    """Tensor operations one step dispatches (``dkfac bench dispatches --launch-bound``), per
    model and method: SGD's and AdamW's beside K-FAC's plain, factor and refresh steps, and
    the plain step over the optimizer it replaces (AdamW under ``eigen_adam``, else SGD)."""

    def table(payloads: Payloads) -> Table:
        rows = []
        for label, name in runs.items():
            counts = payloads[name]["counts"]
            method = payloads[name]["settings"]["method"]
            peer = "adamw" if method == "eigen_adam" else "sgd"
            plain = counts["plain"]["dispatches"]
            rows.append(
                [label]
                + [str(counts[k]["dispatches"]) for k in ("sgd", "adamw", "plain")]
                + [f"{f(plain / counts[peer]['dispatches'])} ({peer})"]
                + [str(counts[k]["dispatches"]) for k in ("factor", "inverse")]
            )
        headers = ["model, method", "SGD", "AdamW", "K-FAC plain step", "plain ÷"]
        return Table([*headers, "factor step", "refresh step"], rows)

    return table


FSDP_STEP_ROWS = (
    ("adamw", "AdamW"),
    ("kfac@1,10", "K-FAC (1, 10)"),
    ("kfac@10,100", "K-FAC (10, 100)"),
)
"""The configurations of ``dkfac bench fsdp-step`` the table shows, with their labels."""


def fsdp_step_table(name: str) -> Callable[[Payloads], Table]:
    """K-FAC's step against AdamW's, both under FSDP2, per world size: the step (the
    slowest rank's, median over seeds), its ratio to AdamW's (the range over seeds), the
    optimizer step alone, and K-FAC's bytes sent a step beside FSDP2's own."""

    def table(payloads: Payloads) -> Table:
        rows = []
        for world, entry in payloads[name]["worlds"].items():
            fsdp = sum(entry["fsdp_bytes_per_step"].values()) / 1024
            for key, label in FSDP_STEP_ROWS:
                row = entry["summary"][key]
                ratios = row["ratios"]
                spread = f"{f(min(ratios))}–{f(max(ratios))}" if key != "adamw" else "–"
                sent = sum(row["ledger_bytes_per_step"].values()) / 1024
                rows.append(
                    [
                        world,
                        label,
                        f(row["step_ms"], 1),
                        f(row["ratio_to_adamw"]),
                        spread,
                        f(row["optimizer_ms"], 1),
                        f"{f(sent, 0)} / {f(fsdp, 0)}",
                    ]
                )
        headers = ["ranks", "optimizer", "step ms", "× AdamW", "× AdamW, seeds"]
        return Table([*headers, "optimizer step ms", "KiB sent a step: K-FAC / FSDP2"], rows)

    return table


def fsdp_memory_table(name: str) -> Callable[[Payloads], Table]:
    """K-FAC under FSDP2 per world size and strategy: memory per rank (factors, inverses,
    moments; the range over the ranks), the parameter shard and AdamW's state beside it,
    and the bytes each rank sends a step at ``(1, 10)`` and ``(10, 100)``."""

    def mib(values: Sequence[float]) -> str:
        low, high = min(values) / 2**20, max(values) / 2**20
        return f(low) if f(low) == f(high) else f"{f(low)}–{f(high)}"

    def table(payloads: Payloads) -> Table:
        rows = []
        for world, ranks in payloads[name]["worlds"].items():
            for strategy in ("replicated", "mem-opt"):
                short, long = f"kfac-{strategy}@1,10", f"kfac-{strategy}@10,100"
                memory = [sum(rank[short]["kfac_memory"].values()) for rank in ranks]
                sent = [
                    sum(ranks[0][key]["bytes_per_step"].values()) / 1024 for key in (short, long)
                ]
                rows.append(
                    [
                        world,
                        strategy,
                        mib(memory),
                        mib([rank["adamw"]["param_shard_bytes"] for rank in ranks]),
                        mib([rank["adamw"]["adam_state_bytes"] for rank in ranks]),
                        f"{f(sent[0], 0)} / {f(sent[1], 0)}",
                    ]
                )
        headers = ["ranks", "strategy", "K-FAC MiB per rank", "parameter shard MiB"]
        return Table([*headers, "AdamW state MiB", "KiB sent a step (1, 10) / (10, 100)"], rows)

    return table


# ---- the default on the training program's tasks (tta, autoencoder, lm) ---------------

DEFAULT_TASK_KINDS = ("tta", "autoencoder", "lm")
"""The kinds of run :func:`default_tasks_table` reads, as ``peers_table``'s ``kind``."""


def task_result(kind: str, entry: Mapping[str, Any]) -> tuple[float, float, float]:
    """``(steps, seconds, final)`` of one optimizer's summary: to the target for ``tta``
    and ``autoencoder`` (infinite where not reached), the loss at the budget for ``lm``
    (then steps are those taken and seconds are per step)."""
    if kind == "tta":
        return entry["median_steps"], entry["median_seconds"], float("nan")
    if kind == "autoencoder":
        steps, seconds = entry["median_steps_to_target"], entry["median_seconds_to_target"]
        return steps, seconds, entry["median_final_loss"]
    return entry["median_steps"], entry["seconds_per_step"], entry["median_final_loss"]


def versus_best_peer(kind: str, summary: Mapping[str, Any]) -> dict[str, float]:
    """Each optimizer's seconds over the fastest peer's (``tta``, ``autoencoder``) or loss
    minus the best peer's (``lm``); the peers are every entry but ``"default"``."""
    results = {key: task_result(kind, entry) for key, entry in summary.items()}
    peers = [r for key, r in results.items() if key != "default"]
    if kind == "lm":
        best = min(p[2] for p in peers)
        return {key: r[2] - best for key, r in results.items()}
    fastest = min(p[1] for p in peers)
    return {key: r[1] / fastest for key, r in results.items()}


def default_tasks_table(runs: Mapping[str, tuple[str, str]]) -> Callable[[Payloads], Table]:
    """The ``for_model`` default (summary key ``"default"``) against the peers of the same
    run on each training task: steps and seconds to the target and the time over the
    fastest peer's (``tta``, ``autoencoder``), or the loss at the time budget and its gap to
    the best peer's (``lm``).

    Args:
        runs: Row label -> ``(kind, JSON file)``, ``kind`` one of :data:`DEFAULT_TASK_KINDS`.
    """

    def table(payloads: Payloads) -> Table:
        rows = []
        for label, (kind, name) in runs.items():
            summary = payloads[name]["summary"]
            versus = versus_best_peer(kind, summary)
            for key, entry in summary.items():
                steps, seconds, final = task_result(kind, entry)
                if kind == "lm":
                    cells = [f(final, 3), f(steps, 0), "–", f"{versus[key]:+.3f} nats"]
                else:
                    loss = f(final, 4) if kind == "autoencoder" else "–"
                    cells = [loss, f(steps, 0), f(seconds), f"{f(versus[key])}×"]
                name_cell = "**dkfac default**" if key == "default" else NAMES.get(key, key)
                rows.append([label, name_cell, f"{entry['lr']:g}", *cells])
        headers = ["task", "optimizer", "lr", "loss at budget", "steps", "seconds"]
        return Table([*headers, "against the best peer"], rows)

    return table
