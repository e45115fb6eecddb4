"""What ``dkfac bench step`` shows of its payload: the phase plot and the summary table."""

from __future__ import annotations

from typing import Any

from dkfac.bench.common import format_table


def plot_breakdown(payload: dict[str, Any], path: str) -> None:
    """Stacked bars of the per-step phase breakdown, SGD and every configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["sgd"]
    stacks: list[dict[str, float]] = [
        {"forward/backward/update": payload["summary"]["sgd_seconds"]}
    ]
    for cname, entry in payload["summary"]["configs"].items():
        for key in ("1,10", "10,100"):
            labels.append(f"{cname}\n({key})")
            stacks.append(entry["amortised"][key]["breakdown"])
    phases = ["forward/backward/update", "precondition", "factor build", "inverse"]
    fig, ax = plt.subplots(figsize=(0.7 * len(labels) + 2, 5))
    bottom = [0.0] * len(labels)
    for phase in phases:
        values = [max(stack.get(phase, 0.0), 0.0) for stack in stacks]
        ax.bar(labels, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("seconds per step")
    ax.tick_params(axis="x", labelrotation=70, labelsize=7)
    settings = payload["settings"]
    ax.set_title(f"{settings['model']} batch {settings['batch_size']} on {settings['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_text(payload: dict[str, Any]) -> str:
    """The printed summary: SGD's and AdamW's step, the noise floor, one row per cost."""
    summary = payload["summary"]
    rows = []
    for cname, entry in summary["configs"].items():
        for key, value in entry["amortised"].items():
            b = value["breakdown"]
            adamw = value.get("ratio_to_adamw")
            rows.append(
                [
                    cname,
                    key,
                    value["seconds"],
                    value["ratio_to_sgd"],
                    value["pooled_ratio_to_sgd"],
                    "-" if adamw is None else adamw,
                    b["precondition"],
                    b["factor build"],
                    b["inverse"],
                ]
            )
    lines = [
        f"SGD: {summary['sgd_seconds']:.3f} s/step; an identical SGD copy measured "
        f"{summary['control_ratio']:.3f}x (the noise floor of the ratios)"
    ]
    if summary.get("adamw_seconds") is not None:
        lines.append(f"AdamW: {summary['adamw_seconds']:.3f} s/step")
    headers = ["factors", "(f,i)", "s/step", "× SGD", "pooled × SGD", "× AdamW"]
    headers += ["precond s", "factor s", "inverse s"]
    lines.append(format_table(headers, rows))
    return "\n".join(lines)
