"""``dkfac bench paired``: two optimizers' validation loss, seed by seed, from ``bench lm`` JSONs.

Reads ``dkfac bench lm`` or ``dkfac bench lm-interleaved`` result files and, for every seed that
both ``--first`` and ``--second`` (their run labels in the JSON's ``runs``, e.g. ``gpt-text``
and ``muon``) ran, takes ``first − second`` of the final loss (at the run's time budget) and,
with ``--at-step N``, of the loss at step ``N`` where both traces have it. Prints each pair,
then the mean, its standard error, the median and how many are below zero; ``--out`` writes
the same as JSON. A seed present in several files is counted once (the first file).

    dkfac bench paired --first gpt-text --second muon --at-step 75 --seconds 60 \
        --out benchmarks/results/lm_paired_recipe_muon_60s.json \
        benchmarks/results/lm_gpt_interleaved_*_seeds*.json
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

from dkfac.bench.arguments import BenchParser

__all__ = ["main", "pairs", "summary"]


def loss_at(run: dict[str, Any], step: int) -> float | None:
    """The validation loss of ``run``'s trace at ``step`` (``None`` if it has none there)."""
    for entry in run["trace"]:
        if int(entry[0]) == step:
            return float(entry[2])
    return None


def summary(diffs: list[float]) -> dict[str, Any]:
    """Count, mean, standard error, median and count below zero of ``diffs``."""
    n = len(diffs)
    if n == 0:
        return {"pairs": 0}
    se = statistics.stdev(diffs) / math.sqrt(n) if n > 1 else float("nan")
    return {
        "pairs": n,
        "mean": statistics.mean(diffs),
        "standard_error": se,
        "median": statistics.median(diffs),
        "below_zero": sum(d < 0 for d in diffs),
    }


def _result_file(path: str) -> dict[str, Any]:
    """A benchmark's JSON result file.

    Raises:
        ValueError: For a file that cannot be read or is not a JSON object (one line).
    """
    try:
        with open(path) as handle:
            payload = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable JSON result file ({err})") from None
    if not isinstance(payload, dict):
        raise ValueError(f"{path}: a result file holds a JSON object, got {type(payload).__name__}")
    return payload


def pairs(
    paths: list[str], first: str, second: str, at_step: int | None, seconds: float | None = None
) -> list[dict[str, Any]]:
    """One row per seed both labels ran: the file, the seed, both losses and steps (only
    files of a ``seconds`` budget when it is given).

    Raises:
        ValueError: For a file that is not a readable JSON result, or whose runs of the two
            labels lack what a pair needs.
    """
    rows: list[dict[str, Any]] = []
    seen: set[int] = set()
    for path in paths:
        payload = _result_file(path)
        runs = payload.get("runs", {})
        if not isinstance(runs, dict) or first not in runs or second not in runs:
            continue
        if seconds is not None and payload.get("settings", {}).get("seconds") != seconds:
            continue
        try:
            rows += _file_pairs(path, runs[first], runs[second], at_step, seen)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(
                f"{path}: its runs of {first!r} and {second!r} are not lists of runs with "
                f"'seed', 'final_loss' and 'steps' ({type(err).__name__}: {err})"
            ) from None
    return rows


def _file_pairs(
    path: str, firsts: Any, seconds: Any, at_step: int | None, seen: set[int]
) -> list[dict[str, Any]]:
    """:func:`pairs`' rows of one file (seeds in ``seen`` skipped, new ones added)."""
    rows = []
    by_seed = {int(r["seed"]): r for r in seconds}
    for run in firsts:
        seed = int(run["seed"])
        other = by_seed.get(seed)
        if other is None or seed in seen:
            continue
        seen.add(seed)
        row = {
            "file": path,
            "seed": seed,
            "first": float(run["final_loss"]),
            "second": float(other["final_loss"]),
            "first_steps": run["steps"],
            "second_steps": other["steps"],
        }
        if at_step is not None:
            row["first_at_step"] = loss_at(run, at_step)
            row["second_at_step"] = loss_at(other, at_step)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dkfac bench paired``: prints the pairs and their summary."""
    parser = BenchParser(prog="dkfac bench paired", description=__doc__.split("\n")[0])
    parser.add_argument("--first", required=True, help="run label whose loss is subtracted from")
    parser.add_argument("--second", required=True, help="run label subtracted")
    parser.add_argument("--at-step", type=int, help="also compare the losses at this step")
    parser.add_argument(
        "--seconds", type=float, help="only the files of this time budget (settings.seconds)"
    )
    parser.add_argument("--out", help="also write the pairs and summaries to this JSON file")
    parser.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    if args.first == args.second:
        parser.error(f"--first and --second must be two labels, got {args.first!r} twice")
    if args.at_step is not None and args.at_step < 0:
        parser.error(f"--at-step must be >= 0, got {args.at_step}")
    try:
        rows = pairs(args.files, args.first, args.second, args.at_step, args.seconds)
    except ValueError as err:
        parser.error(str(err))
    if not rows:
        parser.error(f"no seed has both {args.first!r} and {args.second!r} in these files")
    print(f"| seed | {args.first} | {args.second} | difference | steps |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['seed']} | {row['first']:.3f} | {row['second']:.3f} | "
            f"{row['first'] - row['second']:+.3f} | {row['first_steps']} / {row['second_steps']} |"
        )
    final = summary([r["first"] - r["second"] for r in rows])
    result: dict[str, Any] = {"settings": vars(args), "pairs": rows, "final": final}
    print(f"final: {_text(final)}")
    if args.at_step is not None:
        both = [r for r in rows if r["first_at_step"] is not None and r["second_at_step"]]
        at = summary([r["first_at_step"] - r["second_at_step"] for r in both])
        result["at_step"] = at
        print(f"at step {args.at_step}: {_text(at)}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


def _text(s: dict[str, Any]) -> str:
    if not s["pairs"]:
        return "no pairs"
    return (
        f"{s['pairs']} pairs, mean {s['mean']:+.4f} (standard error {s['standard_error']:.4f}), "
        f"median {s['median']:+.4f}, below zero on {s['below_zero']}"
    )
