"""Run outputs: metrics as JSON lines, progress display, PNG plots and comparison tables.

Each line of ``metrics.jsonl`` is one record with ``kind`` ``"train"`` (a window of training
steps) or ``"eval"`` (test-set evaluation), and the keys ``step``, ``epoch``, ``loss``,
``accuracy``, ``lr``, ``wall_seconds`` (since the run started, across resumes) and
``train_seconds`` (time in training steps only, without evaluation and checkpoints); train
records also carry ``time_forward_backward`` and ``time_optimizer`` (mean seconds per step;
for K-FAC the optimizer time is the preconditioner step plus the inner step). Runs on
byte-level text (``--data text``) add ``bits_per_byte`` (the loss, in nats per byte, over
ln 2); their loss and accuracy are per byte (next-byte prediction).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

Record = dict[str, Any]


def bits_per_byte(loss: float) -> float:
    """Bits per byte of a mean cross-entropy in nats per byte: ``loss / ln 2``."""
    return loss / math.log(2.0)


class MetricsWriter:
    """Appends records to ``metrics.jsonl`` (a no-op writer when ``path`` is ``None``)."""

    def __init__(self, path: Path | None, keep_until_step: int | None = None) -> None:
        self.path = path
        self.records: list[Record] = []
        if path is None:
            return
        if keep_until_step is not None and path.exists():
            # Resuming: keep what was logged up to the checkpoint, drop what came after it.
            self.records = [r for r in read_metrics(path) if r["step"] <= keep_until_step]
        path.write_text("".join(json.dumps(r) + "\n" for r in self.records))

    def write(self, record: Record) -> None:
        """Keeps ``record`` and appends it to the file."""
        self.records.append(record)
        if self.path is not None:
            with self.path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")


def read_metrics(path: Path) -> list[Record]:
    """The records of a ``metrics.jsonl`` file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Progress:
    """A tqdm bar on a terminal, plain log lines otherwise; silent when not ``enabled``."""

    def __init__(self, total: int, initial: int, enabled: bool, stream: TextIO | None = None):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.bar: Any = None
        if enabled and self.stream.isatty():
            try:
                from tqdm import tqdm
            except ImportError:  # pragma: no cover - tqdm is an app dependency
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(
                    total=total, initial=initial, unit="step", file=self.stream, dynamic_ncols=True
                )

    def update(self, steps: int, record: Record | None = None) -> None:
        """Advances the bar by ``steps``; with ``record``, shows or logs its numbers."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(steps)
            if record is not None:
                self.bar.set_postfix_str(summary_fields(record), refresh=False)
        elif record is not None:
            self.log(f"[{record['kind']}] " + summary_fields(record))

    def log(self, message: str) -> None:
        """Prints a line (through tqdm when a bar is shown)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        """Closes the bar."""
        if self.bar is not None:
            self.bar.close()


def summary_fields(record: Record) -> str:
    """``step=... epoch=... loss=... acc=... lr=... t=...s`` for one record."""
    parts = [f"step={record['step']}", f"epoch={record['epoch']:.2f}"]
    if record.get("loss") is not None:
        parts.append(f"loss={record['loss']:.4f}")
    if record.get("bits_per_byte") is not None:
        parts.append(f"bpb={record['bits_per_byte']:.4f}")
    if record.get("accuracy") is not None:
        parts.append(f"acc={record['accuracy']:.4f}")
    if record.get("lr") is not None:
        parts.append(f"lr={record['lr']:.3g}")
    parts.append(f"t={record['train_seconds']:.1f}s")
    return " ".join(parts)


def final_line(
    label: str,
    final: Record,
    hit: Record | None,
    target: float | None,
    folder: Path | None,
    skipped: int = 0,
) -> str:
    """The one-line summary printed at the end of a run."""
    acc = "" if final["accuracy"] is None else f"test accuracy {final['accuracy']:.4f}, "
    bpb = final.get("bits_per_byte")
    per_byte = "" if bpb is None else f" ({bpb:.4f} bits per byte)"
    text = (
        f"{label}final: {acc}test loss {final['loss']:.4f}{per_byte}, {final['step']} steps, "
        f"{final['train_seconds']:.1f} s training"
    )
    if target is not None:
        text += (
            f", target {target} reached at step {hit['step']} ({hit['train_seconds']:.1f} s)"
            if hit
            else f", target {target} not reached"
        )
    if skipped:
        text += f", {skipped} steps skipped (non-finite gradients)"
    return text + (f"; run folder {folder}" if folder is not None else "")


# A final test loss this many times the reference loss is a diverged run: no classifier that
# learns ends 100x above uniform guessing (ln(classes)), no autoencoder 100x above its first
# logged training loss.
DIVERGED_FACTOR = 100.0


def diagnose(
    records: Sequence[Record],
    final: Record,
    skipped: int,
    steps: int,
    num_classes: int | None,
) -> str | None:
    """Why a finished run did not train, in one sentence (``None``: it did).

    A run fails when its final test loss is not finite, when more than half of its optimizer
    steps were skipped for non-finite gradients, or when its final test loss is at least
    :data:`DIVERGED_FACTOR` times the reference: ``ln(num_classes)`` (the loss of a uniform
    guess) for a classifier, the first logged training loss for the autoencoder.

    Args:
        records: The run's metric records.
        final: The final evaluation record.
        skipped: Optimizer steps skipped for non-finite gradients (K-FAC's count).
        steps: Optimizer steps taken in total.
        num_classes: Classes of a classifier; ``None`` for the autoencoder.
    """
    hint = "lower --lr or raise --damping"
    loss = float(final["loss"])
    if not math.isfinite(loss):
        return f"the final test loss is {loss}: the run diverged ({hint})"
    if steps and 2 * skipped > steps:
        return (
            f"{skipped} of {steps} optimizer steps were skipped for non-finite gradients: "
            f"the run did not train ({hint})"
        )
    if num_classes is not None:
        reference, what = math.log(num_classes), f"a uniform guess over {num_classes} classes"
    else:
        first = [r["loss"] for r in records if r["kind"] == "train" and math.isfinite(r["loss"])]
        reference, what = (first[0] if first else math.inf), "the first logged training loss"
    if loss >= DIVERGED_FACTOR * reference:
        return (
            f"the final test loss {loss:.4g} is over {DIVERGED_FACTOR:g} times that of {what} "
            f"({reference:.4g}): the run diverged ({hint})"
        )
    return None


# ----------------------------------------------------------------------- plots
def plot_runs(runs: Mapping[str, Sequence[Record]], path: Path, title: str = "") -> Path:
    """Loss and accuracy against steps and against training seconds, one line per run.

    Args:
        runs: Label -> records (a single run is ``{label: records}``).
        path: The PNG to write.
        title: Figure title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), squeeze=False)
    for col, x_key in enumerate(("step", "train_seconds")):
        for row, y_key in enumerate(("loss", "accuracy")):
            ax = axes[row][col]
            for index, (label, records) in enumerate(runs.items()):
                color = f"C{index % 10}"  # one colour per run: dotted train, solid test
                for kind, style in (("train", ":"), ("eval", "-")):
                    pts = [
                        (r[x_key], r[y_key])
                        for r in records
                        if r["kind"] == kind and r.get(y_key) is not None
                    ]
                    if pts:
                        xs, ys = zip(*pts, strict=True)
                        name = "test" if kind == "eval" else "train"
                        ax.plot(xs, ys, style, color=color, label=f"{label} {name}")
            ax.set_xlabel("step" if x_key == "step" else "training seconds")
            ax.set_ylabel(y_key)
            if y_key == "loss":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------- comparisons
def target_reached(records: Sequence[Record], target: float | None) -> Record | None:
    """The first eval record with ``accuracy >= target`` (``None`` if never or no target)."""
    if target is None:
        return None
    for r in records:
        if r["kind"] == "eval" and r.get("accuracy") is not None and r["accuracy"] >= target:
            return r
    return None


def run_summary(label: str, records: Sequence[Record], target: float | None) -> Record:
    """One row of a comparison table from a run's records."""
    evals = [r for r in records if r["kind"] == "eval"]
    last = evals[-1] if evals else None
    hit = target_reached(records, target)
    steps = max((r["step"] for r in records), default=0)
    seconds = max((r["train_seconds"] for r in records), default=0.0)
    accuracies = [r["accuracy"] for r in evals if r.get("accuracy") is not None]
    return {
        "optimizer": label,
        "final_accuracy": None if last is None else last.get("accuracy"),
        "best_accuracy": max(accuracies) if accuracies else None,
        "final_loss": None if last is None else last["loss"],
        "final_bits_per_byte": None if last is None else last.get("bits_per_byte"),
        "steps": steps,
        "train_seconds": seconds,
        "seconds_per_step": seconds / steps if steps else None,
        "target_accuracy": target,
        "steps_to_target": None if hit is None else hit["step"],
        "seconds_to_target": None if hit is None else hit["train_seconds"],
    }


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if math.isfinite(value) and abs(value) < 10:
            return f"{value:.4f}"
        return f"{value:.1f}"
    return str(value)


def markdown_table(rows: Sequence[Record]) -> str:
    """A markdown table of :func:`run_summary` rows.

    With a target accuracy the table leads with the time and steps to it, fastest first (runs
    that never reached it last, in their given order); without one, rows keep their order.
    """
    target = rows[0]["target_accuracy"] if rows else None
    lead = [("seconds_to_target", "s to target"), ("steps_to_target", "steps to target")]
    columns = [
        ("optimizer", "optimizer"),
        *(lead if target is not None else []),
        ("final_accuracy", "final test acc"),
        ("best_accuracy", "best test acc"),
        ("final_loss", "final test loss"),
        ("final_bits_per_byte", "final test bits/byte"),
        ("steps", "steps"),
        ("train_seconds", "train s"),
        ("seconds_per_step", "s/step"),
    ]
    columns = [
        (key, head)
        for key, head in columns
        if key != "final_bits_per_byte" or any(row.get(key) is not None for row in rows)
    ]
    if target is not None:
        rows = sorted(
            rows, key=lambda r: (r["seconds_to_target"] is None, r["seconds_to_target"] or 0)
        )
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row[k]) for k, _ in columns) + " |")
    head = (
        f"Time to test accuracy {target} (training seconds, evaluations not counted), "
        "fastest first.\n\n"
        if target is not None
        else ""
    )
    return head + "\n".join(lines) + "\n"


def write_comparison(
    runs: Mapping[str, Sequence[Record]], folder: Path, target: float | None, title: str = ""
) -> list[Record]:
    """Writes ``compare.md``, ``compare.json`` and ``compare.png`` into ``folder``."""
    rows = [run_summary(label, records, target) for label, records in runs.items()]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "compare.md").write_text(markdown_table(rows))
    (folder / "compare.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot_runs(runs, folder / "compare.png", title)
    return rows
