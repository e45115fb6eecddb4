"""The sections of BENCHMARKS.md: which JSON each reads, its tables, plot and prose.

How to add a section (or a figure to one):

1. Put the benchmark's JSON under ``benchmarks/results/`` (every ``dkfac bench`` command
   writes one with its ``machine`` and ``command``; keep that file: the page cites it).
2. Append a :class:`~dkfac.bench.page.Section` to :data:`SECTIONS`: its ``sources`` (the
   JSON paths under ``benchmarks/results/``), its ``tables`` (reuse a builder of
   :mod:`dkfac.bench.results_tables` or write one of a few lines), its ``plot`` if any, and
   its prose. A figure in the prose is a ``{placeholder}`` that ``values`` fills from the
   JSON, or a literal number the JSON holds.
3. Run ``dkfac bench report`` (``make benchmarks``) and commit the page, the plot and the
   JSON. ``tests/bench/test_results_page.py`` fails until the page is the one built from
   the JSON and every literal figure of the prose is in the section's files.

A newer result replaces the old one in its section (change ``sources``); nothing
superseded stays on the page.
"""

from __future__ import annotations

import statistics
from typing import Any

from dkfac.bench.page import Payloads, Section, Table
from dkfac.bench.results_tables import (
    amortised,
    comm_table,
    cpu_step_table,
    default_tasks_table,
    dispatch_table,
    f,
    fsdp_memory_table,
    fsdp_step_table,
    gpu_step_table,
    lm_phases_table,
    paired_table,
    peers_table,
    plot_comm,
    plot_soak,
    plot_step,
    plot_suite,
    plot_with,
    soak_table,
    suite_table,
    task_result,
    versus_best_peer,
)

__all__ = ["HEAD", "SECTIONS"]

HEAD = """
# Benchmarks

The current results of dkfac against the optimizers a user would pick instead (AdamW, Muon,
SOAP) and against plain SGD, one section per benchmark. Every comparison is measured side by
side in one run (the contenders' steps interleaved where the machine drifts), with medians
over seeds and repeats; CPU runs use one torch thread. Read ratios and step counts across
tables, not absolute times: the machines differ.

This page is generated: `dkfac bench report` (or `make benchmarks`) rebuilds it and its
plots from the JSON files in `benchmarks/results/`, which hold every repeat, the machine and
the exact command. How to add a section: `src/dkfac/bench/results_page.py`. What was tried
and did not win: [docs/tried.md](docs/tried.md).
"""

ALIASES = {
    "python benchmarks/probes/lm_step_phases.py": "dkfac bench phases",
    "python benchmarks/probes/fsdp_memory.py": "dkfac bench fsdp-memory",
    "python benchmarks/probes/conv_factor_paths.py": "dkfac bench conv-paths",
    "python benchmarks/probes/trainer_accumulation.py": "dkfac bench accumulation",
    "python benchmarks/probes/lm_interleaved.py": "dkfac bench lm-interleaved --muon-dtype float32",
    "python benchmarks/probes/lm_paired.py": "dkfac bench paired",
    **{
        f"python benchmarks/probes/muon_float32.py {task}": (
            f"dkfac bench {task} --muon-dtype float32"
        )
        for task in ("tta", "autoencoder", "lm")
    },
}
"""The programs some results were recorded with -> the command that runs them today."""

CPU_RUNS = {
    "eigen_adam": tuple(f"step_resnet20_cpu_launches_eigen_adam_after_{i}.json" for i in (1, 2, 3)),
    "eigen": tuple(f"step_resnet20_cpu_launches_eigen_after_{i}.json" for i in (1, 2)),
}

H200 = "h200_2026_11_28/"
GUARD = "h200_2026_11_28_device_guard/"  # the finiteness guard on the device
GPU_MODELS = {
    "ResNet-20": GUARD + "step_resnet20_cuda_head.json",
    "ResNet-32": H200 + "step_resnet32_cuda.json",
    "ResNet-56": H200 + "step_resnet56_cuda.json",
    "ResNet-20, `eigen_adam`": GUARD + "step_resnet20_cuda_eigen_adam_head.json",
    "GPT 4 × 128, batch 32 × 128, `eigen_adam`": GUARD + "step_gpt_cuda_eigen_adam_head.json",
    "ResNet-50 224², bf16 autocast, 32-sample bf16 factors": (
        GUARD + "step_resnet50_cuda_bf16_head.json"
    ),
}
LM_PHASES = H200 + "lm_phases_cuda.json"

TTA_RUNS = {
    "AVX-512 CPU, split 0": "tta_digits_v7.json",
    "AVX-512 CPU, split 1": "tta_digits_v7_split1.json",
    "AVX2 CPU (bf16 emulated)": "tta_digits_v9_avx2.json",
    "AVX2 CPU, Muon in float32": "tta_muon_float32_avx2.json",
}
AE_RUNS = {
    "AVX-512 CPU, seeds 0–2": "autoencoder_digits_v12.json",
    "AVX-512 CPU, held-out seeds": "autoencoder_digits_v13_heldout_split1.json",
    "AVX2 CPU, Muon in float32": "autoencoder_muon_float32_avx2.json",
}
LM_RUNS = {
    "AVX2 CPU, seeds 150–152": "lm_gpt_interleaved_peers_avx2_seeds150.json",
    "AVX2 CPU, nine seeds from 240": "lm_gpt_interleaved_muon32_avx2_seeds240.json",
    "AMX CPU (H200 host), Muon in bf16": (
        "h200_2026_11_27/lm_gpt_interleaved_h200host_seeds200.json"
    ),
}
LM_PAIRED = "lm_paired_recipe_muon_60s.json"
HOST_TIME = "host_time_plain_step.json"

DISPATCHES = {
    "ResNet-20 batch 128, `eigen_adam`": "dispatches_resnet20_eigen_adam_launch_bound.json",
    "ResNet-20 batch 128, `eigen`": "dispatches_resnet20_eigen_launch_bound.json",
    "GPT 4 × 128, batch 32 × 128, `eigen_adam`": "dispatches_gpt_eigen_adam_launch_bound.json",
    "ResNet-20 batch 128, `for_model`'s options": "dispatches_resnet20_default_launch_bound.json",
    "GPT 4 × 128, batch 32 × 128, `for_model`'s options": (
        "dispatches_gpt_default_launch_bound.json"
    ),
}
FSDP_MEMORY = "fsdp_memory_cpu.json"
FSDP_STEP = "fsdp_step_cpu.json"
DEFAULT_TASKS = {
    "digits CNN": ("tta", "tta_digits_default_v22.json"),
    "autoencoder": ("autoencoder", "autoencoder_digits_default_v22.json"),
    "language model": ("lm", "lm_gpt_default_v22.json"),
}
TTA_TEN_SEEDS = "tta_digits_default_v21_seeds10.json"
SUITE = "suite_default_v22.json"
EARLY_REFRESH = "early_refresh.json"
LONG_RUN = "long_run_deepmlp.json"
WIDE_SIDES = "one_sided_memory.json"
SUITE_ALL_PEERS = "suite_default_v1.json"
GROUPED = "grouped_conv_digits.json"
UNSEEN = "unseen_families.json"
SMALL_BATCH = "suite_b64.json"
SMALL_BATCH_AE = {
    "none": "suite_b64_autoencoder_overhead_none.json",
    "bases": "suite_b64_autoencoder_bases.json",
}
STEP_ANATOMY = "step_anatomy.json"
GROUPED_MODELS = {"convnext": "ConvNeXt-like", "mobilenet": "MobileNet-like"}
SOAK_RUNS = {
    "eigen": "soak-digits-2ranks.json",
    "cholesky": "soak-digits-2ranks-cholesky.json",
    "smw": "soak-digits-2ranks-smw.json",
    "auto": "soak-digits-2ranks-auto.json",
}


def _cpu_values(p: Payloads) -> dict[str, str]:
    sgd = [p[n]["summary"]["sgd_seconds"] for n in CPU_RUNS["eigen_adam"]]
    return {"sgd": f(min(sgd)), "sgd_high": f(max(sgd))}


def _gpu_values(p: Payloads) -> dict[str, str]:
    r20 = amortised(p[GPU_MODELS["ResNet-20"]], "10,100")
    gpt = amortised(p[GPU_MODELS["GPT 4 × 128, batch 32 × 128, `eigen_adam`"]], "10,100")
    phases = p[LM_PHASES]["phases"]
    recipe = phases["benchmarks/recipes/gpt-text.toml"]["total_ms"] / phases["muon"]["total_ms"]
    return {
        "r20_sgd": f(r20["ratio_to_sgd"]),
        "r20_adamw": f(r20["ratio_to_adamw"]),
        "gpt_adamw": f(gpt["ratio_to_adamw"]),
        "lm_vs_muon": f(recipe),
    }


def _host_values(p: Payloads) -> dict[str, str]:
    host = p[HOST_TIME]["results"]
    return {
        "host_r20": f(host["resnet20"]["dkfac_vs_adamw"]),
        "host_gpt": f(host["gpt"]["dkfac_vs_adamw"]),
    }


def _wide_values(p: Payloads) -> dict[str, Any]:
    after = p[WIDE_SIDES]["results"]["after"]
    mlp = after["mlp"]
    rounds = [r["dkfac_vs_adamw"] for r in mlp["rounds"]]
    return {
        "mlp_bytes": f"{mlp['statistics']['bytes']:,}",
        "mlp_dense": f"{mlp['statistics']['as_matrix_bytes']:,}",
        "mlp_ratio": f(mlp["dkfac_vs_adamw"]),
        "mlp_low": f(min(rounds)),
        "mlp_high": f(max(rounds)),
        "gpt_blocks": f"{after['gpt_basis_block_size_64']['bytes']:,}",
        "gpt_whole": f"{after['gpt']['bytes']:,}",
    }


def _suite_values(p: Payloads) -> dict[str, Any]:
    tasks = {task["task"]: task for task in p[SUITE]["tasks"]}
    verdicts = [task["summary"]["verdict"] for task in tasks.values()]

    def seeds(family: str, name: str = "dkfac", split: str = "0") -> str:
        reached = [run["reached"] for run in tasks[family]["runs"][split][name]]
        return ", ".join("–" if r is None else str(r) for r in reached)

    def step(family: str, name: str) -> float:
        return float(tasks[family]["summary"]["optimizers"][name]["step_vs_adamw"])

    def raw(family: str) -> float:
        table = tasks[family]["summary"]["optimizers"]
        best = min(table[n]["raw_median_seconds"] for n in table if n != "dkfac")
        return float(table["dkfac"]["raw_median_seconds"]) / best

    raws = {family: raw(family) for family in tasks}
    anatomy = _anatomy_values(p[STEP_ANATOMY]["families"])
    return {
        **anatomy,
        "raw_wins": sum(ratio <= 1.0 for ratio in raws.values()),
        "raw_ratios": ", ".join(f"{family} {f(ratio)}" for family, ratio in raws.items()),
        "gpt_seeds": seeds("gpt"),
        "gpt_lr": f(tasks["gpt"]["chosen_lr"]["dkfac"]),
        "gpt_split1": seeds("gpt", split="1"),
        "gpt_muon_split1": seeds("gpt", "muon32", split="1"),
        "max_steps": p[SUITE]["settings"]["max_steps"],
        "gpt_early_split1": _early_reached(p[EARLY_REFRESH], "gpt", "early_split1"),
        "gpt_early_lr": f(_early_row(p[EARLY_REFRESH], "gpt")["lr"]),
        "ae_seeds": seeds("autoencoder"),
        "ae_muon_seeds": seeds("autoencoder", "muon32"),
        "ae_muon_step": f(step("autoencoder", "muon32") / step("autoencoder", "dkfac")),
        "families": len(verdicts),
        "time_wins": sum(v["time_at_most_best_peer"] for v in verdicts),
        "step_wins": sum(v["steps_at_most_fewest_peer"] for v in verdicts),
        "within": sum(v["step_within_budget"] for v in verdicts),
    }


def _early_row(payload: Any, family: str) -> dict[str, Any]:
    """The row of ``early_refresh.json`` for ``family``."""
    return next(row for row in payload["rows"] if row["family"] == family)


def _early_reached(payload: Any, family: str, arm: str) -> str:
    """The steps each seed of ``arm`` (e.g. ``"early_split1"``) took, ``–`` not reached."""
    reached = _early_row(payload, family)[arm]["reached"]
    return ", ".join("–" if r is None else str(r) for r in reached)


def _early_table(p: Payloads) -> Table:
    """Median steps to the target with the budget's early refresh and without it."""
    rows = []
    for row in p[EARLY_REFRESH]["rows"]:
        cells = [
            " / ".join(f(row[f"{arm}_split{split}"]["median"], 0) for split in (0, 1))
            for arm in ("early", "plain")
        ]
        rows.append([row["family"], f"{row['lr']:g}", *cells])
    headers = ["family", "lr", "with the early refresh (split 0 / 1)", "without (split 0 / 1)"]
    return Table(headers, rows)


def _after_target(run: dict[str, Any]) -> list[float]:
    """A long run's accuracies at the 50-step marks from the step it reached the target."""
    if run["reached"] is None:
        return []
    marks = run["accuracy_every_50"]
    return [a for k, a in enumerate(marks) if 50 * (k + 1) >= run["reached"]]


def _long_run_cells(row: dict[str, Any]) -> dict[str, str]:
    """One arm of ``long_run_deepmlp.json``: each seed's steps to the target, the median
    final accuracy, the lowest accuracy of any seed at a 50-step mark once it had reached
    the target, the median norm."""
    runs = row["runs"]
    after = [a for r in runs for a in _after_target(r)]
    return {
        "reached": ", ".join("–" if r["reached"] is None else str(r["reached"]) for r in runs),
        "final": f(statistics.median(r["accuracy_every_50"][-1] for r in runs), 3),
        "lowest": f(min(after), 3) if after else "–",
        "norm": f(statistics.median(r["norm"] for r in runs), 0),
    }


def _long_run_table(p: Payloads) -> Table:
    """Each arm of the long runs: optimizer, lr and :func:`_long_run_cells`."""
    rows = []
    for row in p[LONG_RUN]["rows"]:
        cells = _long_run_cells(row)
        name = "dkfac " + row["arm"] if row["optimizer"] == "dkfac" else row["optimizer"]
        rows.append([name, f"{row['lr']:g}", *cells.values()])
    headers = [
        "optimizer",
        "lr",
        "steps to the target (each seed)",
        "final accuracy (median)",
        "lowest accuracy after the target (at the 50-step marks)",
        "weights' norm at the end (median)",
    ]
    return Table(headers, rows)


def _long_run_values(p: Payloads) -> dict[str, str]:
    """The long runs' figures: the default at its lowest and highest rate, and the lowest
    accuracy after the target of the other ``for_model`` arms."""
    payload = p[LONG_RUN]
    default = [r for r in payload["rows"] if r["arm"] == "default"]
    low = min(default, key=lambda r: r["lr"])
    high = max(default, key=lambda r: r["lr"])
    others = [
        a
        for r in payload["rows"]
        if r["optimizer"] == "dkfac" and r["arm"] != "default"
        for run in r["runs"]
        for a in _after_target(run)
    ]
    return {
        "steps": str(payload["steps"]),
        "target": f"{payload['target']:.0%}",
        "lr_low": f"{low['lr']:g}",
        "lr_high": f"{high['lr']:g}",
        "low_lowest": _long_run_cells(low)["lowest"],
        "high_final": _long_run_cells(high)["final"],
        "norm_low": _long_run_cells(low)["norm"],
        "norm_high": _long_run_cells(high)["norm"],
        "others_lowest": f(min(others), 3),
    }


def _anatomy_values(families: dict[str, Any]) -> dict[str, str]:
    """The MLP's and the autoencoder's step split (``step_anatomy.json``), as fractions of
    AdamW's whole step in the same run: the products alone, the step at that cost, the rest
    of the default's extra, and the step in the launch-bound forms."""
    values = {}
    for family, key in (("mlp", "mlp"), ("autoencoder", "ae")):
        record = families[family]
        adamw = record["adamw"]["total_ms"]
        algebra = record["algebra_ms"] / adamw
        extra = record["dkfac"]["total_ms"] / adamw - 1.0
        values[f"{key}_algebra"] = f"{algebra:.0%}"
        values[f"{key}_floor"] = f(1.0 + algebra)
        values[f"{key}_host"] = f"{extra - algebra:.0%}"
        values[f"{key}_launch"] = f(record["launch_bound_forms"]["total_vs_adamw"])
    return values


def _unseen_values(p: Payloads) -> dict[str, Any]:
    tasks = {task["task"]: task for task in p[UNSEEN]["tasks"]}
    verdicts = [task["summary"]["verdict"] for task in tasks.values()]
    llama = tasks["llama"]

    def reached(name: str) -> str:
        runs = llama["runs"]["1"][name]
        return ", ".join("–" if r["reached"] is None else str(r["reached"]) for r in runs)

    missed = [r for r in llama["runs"]["1"]["dkfac"] if r["reached"] is None]
    late = [metric for r in missed for step, _, metric in r["trace"] if step >= 60]
    return {
        "late_low": f(min(late, default=None)),
        "late_high": f(max(late, default=None)),
        "families": len(verdicts),
        "step_wins": sum(v["steps_at_most_fewest_peer"] for v in verdicts),
        "time_wins": sum(v["time_at_most_best_peer"] for v in verdicts),
        "within": sum(v["step_within_budget"] for v in verdicts),
        "max_steps": p[UNSEEN]["settings"]["max_steps"],
        "llama_lr": f(llama["chosen_lr"]["dkfac"]),
        "llama_dkfac": reached("dkfac"),
        "llama_adamw": reached("adamw"),
        "llama_muon": reached("muon32"),
        "mixer_lr": f(tasks["mixer"]["chosen_lr"]["dkfac"], 3),
    }


def _small_batch_values(p: Payloads) -> dict[str, Any]:
    tasks = {task["task"]: task for task in p[SMALL_BATCH]["tasks"]}
    verdicts = [task["summary"]["verdict"] for task in tasks.values()]

    def autoencoder(payload: Any, name: str = "dkfac") -> dict[str, Any]:
        (task,) = (t for t in payload["tasks"] if t["task"] == "autoencoder")
        return dict(task["summary"]["optimizers"][name])

    budget, muon = autoencoder(p[SMALL_BATCH]), autoencoder(p[SMALL_BATCH], "muon32")
    none, bases = (autoencoder(p[SMALL_BATCH_AE[k]]) for k in ("none", "bases"))
    return {
        "batch": p[SMALL_BATCH]["settings"]["batch_size"],
        "families": len(verdicts),
        "step_wins": sum(v["steps_at_most_fewest_peer"] for v in verdicts),
        "time_wins": sum(v["time_at_most_best_peer"] for v in verdicts),
        "within": sum(v["step_within_budget"] for v in verdicts),
        "ae_dkfac": f(budget["median_steps"], 0),
        "ae_muon": f(muon["median_steps"], 0),
        "ae_bases": f(bases["median_steps"], 0),
        "ae_none": f(none["median_steps"], 0),
    }


def _default_task_values(p: Payloads) -> dict[str, Any]:
    versus = {
        label: versus_best_peer(kind, p[name]["summary"])["default"]
        for label, (kind, name) in DEFAULT_TASKS.items()
    }
    steps = task_result("tta", p[DEFAULT_TASKS["digits CNN"][1]]["summary"]["default"])[0]
    ten = p[TTA_TEN_SEEDS]["summary"]
    seeds = p[TTA_TEN_SEEDS]["settings"]["seeds"]
    lm_runs = p[DEFAULT_TASKS["language model"][1]]["runs"]
    lm_steps = [run["steps"] for name in lm_runs for run in lm_runs[name]]
    slopes = []  # the loss's fall per step between the last two evaluations 25 steps apart
    for run in lm_runs["default"]:
        evals = [(step, value) for step, _, value in run["trace"] if step % 25 == 0]
        (first, before), (last, after) = evals[-2:]
        slopes.append((before - after) / (last - first))
    return {
        "tta_steps": f(steps, 0),
        "tta_time": f(versus["digits CNN"]),
        "ten_seeds": seeds,
        "ten_steps": f(task_result("tta", ten["default"])[0], 0),
        "ten_muon_steps": f(task_result("tta", ten["muon"])[0], 0),
        "ten_time": f(versus_best_peer("tta", ten)["default"]),
        "lm_fewest": min(lm_steps),
        "lm_most": max(lm_steps),
        "lm_slope": f(statistics.median(slopes), 3),
        "ae_time": f(versus["autoencoder"]),
        "lm_gap": f"{versus['language model']:+.3f}",
        "lm_gap_steps": f(abs(versus["language model"]) / statistics.median(slopes), 0),
    }


def _fsdp_step_values(p: Payloads) -> dict[str, Any]:
    worlds = p[FSDP_STEP]["worlds"]
    return {
        f"r{world}": f(entry["summary"]["kfac@10,100"]["ratio_to_adamw"])
        for world, entry in worlds.items()
    }


def _lm_values(p: Payloads) -> dict[str, Any]:
    nine = p[LM_RUNS["AVX2 CPU, nine seeds from 240"]]["summary"]
    final = p[LM_PAIRED]["final"]
    return {
        "nine_recipe": f(nine["gpt-text"]["median_final_loss"], 3),
        "nine_muon": f(nine["muon"]["median_final_loss"], 3),
        "pairs": final["pairs"],
        "mean": f(final["mean"], 3),
        "se": f(final["standard_error"], 3),
        "below": final["below_zero"],
    }


def _grouped_table(p: Payloads) -> Table:
    """Median steps to the target on each split with the grouped convolutions left to Adam
    and under the default, the default's step over the other's, and its time over it."""
    rows = []
    for key, label in GROUPED_MODELS.items():
        entry = p[GROUPED]["models"][key]
        medians = {}
        for arm in ("adam_dw", "unitwise"):
            runs = [*entry["heldout"][arm], *entry["heldout_split1"][arm]]
            medians[arm] = statistics.median(run["reached"] or float("inf") for run in runs)
        split = {
            arm: " / ".join(f(entry[k][arm], 0) for k in ("median_steps", "median_steps_split1"))
            for arm in medians
        }
        ratio = entry["step_time"]["ratio_cpu"]
        time = ratio * medians["unitwise"] / medians["adam_dw"]
        steps = [split["adam_dw"], split["unitwise"], f(medians["adam_dw"], 1)]
        cells = [*steps, f(medians["unitwise"], 1), f(ratio), f"**{f(time)}**"]
        rows.append([label, f"{entry['best_lr']['unitwise']:g}", *cells])
    headers = ["model", "lr", "steps, to Adam (split 0 / 1)", "steps, default (split 0 / 1)"]
    return Table([*headers, "median, to Adam", "median, default", "step ×", "time ×"], rows)


SECTIONS: tuple[Section, ...] = (
    Section(
        title="Per-step cost on a CPU",
        sources=(*CPU_RUNS["eigen_adam"], *CPU_RUNS["eigen"]),
        text="""
CIFAR ResNet-20 on random 32×32 inputs, batch 128, one thread: SGD, AdamW and the K-FAC step
kinds (precondition only, with a factor update, with a basis refresh) measured interleaved
on one batch; a schedule "factors every f steps, basis every i" costs the exact amortisation
of the three kinds. `eigen_adam` is the `for_model` preconditioner with power refresh and
`rotation_dtype="auto"`. SGD's step took {sgd}–{sgd_high} s on this machine.
""",
        tables=(cpu_step_table(CPU_RUNS),),
        values=_cpu_values,
        plot=("step_resnet20_cpu.png", plot_step(CPU_RUNS["eigen_adam"][0])),
    ),
    Section(
        title="Per-step cost on a GPU",
        sources=(*GPU_MODELS.values(), LM_PHASES),
        text="""
The same measurement on an NVIDIA H200 (`dkfac bench step --device cuda`, batch 128 unless
said, fp32, medians of 5 repeats, exact factors, `eigen` unless said). ResNet-32 and
ResNet-56 were measured before the finiteness guard kept its flags on the device (the
other rows after). On this GPU a
small model's step is bound by the host: ResNet-20 at (10, 100) costs {r20_sgd}× SGD
({r20_adamw}× AdamW) and the GPT with `eigen_adam` {gpt_adamw}× AdamW, where a CPU pays the
small ratios of the section above. The second table is the language model's step phase by
phase (synchronised timers): the recipe's step is {lm_vs_muon}× Muon's there.
""",
        tables=(
            gpu_step_table(GPU_MODELS),
            lm_phases_table(LM_PHASES, {"benchmarks/recipes/gpt-text.toml": "dkfac recipe"}),
        ),
        values=_gpu_values,
        plot=("step_resnet20_cuda.png", plot_step(GPU_MODELS["ResNet-20"])),
        commands=(
            "GPU_RUNS_SECONDS=420 bash benchmarks/gpu_runs.sh $OUT",
            "dkfac bench step --device cuda --model resnet20 --batch-size 128 --repeats 5",
        ),
    ),
    Section(
        title="Operations a step dispatches",
        sources=(*DISPATCHES.values(), HOST_TIME),
        text="""
On a GPU a small model's step is bound by the host's kernel launches, so the number of
tensor operations a step dispatches is a proxy for its cost there that any machine can
count (`dkfac bench dispatches --launch-bound`: the operations of one step on a CPU, with
the code paths a CUDA device takes). SGD's and AdamW's steps include the forward and
backward; K-FAC's plain step preconditions with the current bases, its factor step also
captures and updates the factors, and its refresh step also recomputes the bases. The
last two rows take `for_model`'s options (its overhead budget aside): the hidden layers'
updates are orthogonalised by the Newton–Schulz iteration, whose steps for every hidden
layer of every shape run as one zero-padded batched iteration on such a device (their
moments with the other layers' in one flat pass).
""",
        tables=(dispatch_table(DISPATCHES),),
        notes="""
A count misses the host's Python around each operation.
`benchmarks/probes/host_time.py` times it: the same two graphs at widths where every kernel
takes microseconds (ResNet-20 2 to 8 channels wide, the GPT 8 wide), the CUDA code paths
forced, `for_model` with its factors never refreshed against AdamW in alternated blocks
(the median of rounds that build both afresh). Its plain step costs {host_r20}× AdamW's
host time on ResNet-20 and {host_gpt}× on the GPT; from one process to the next these
ratios move by several hundredths.
""",
        values=_host_values,
    ),
    Section(
        title="The default on six model families",
        sources=(SUITE, SUITE_ALL_PEERS, STEP_ANATOMY, EARLY_REFRESH),
        text="""
`KFACOptimizer.for_model(model)` with only its lr swept, on small models no recipe was tuned
for (`dkfac bench suite`): a vision transformer, a residual CNN with BatchNorm, an MLP with
LayerNorm, the digits CNN and autoencoder (digits) and a byte-level GPT (the standard
library's text), each to a held-out target. Every optimizer gets an lr grid of the same size
swept on one seed: five rates doubling over 16×, placed where that optimizer's best rates
lie (Muon's best spans 0.02 on the transformers to 0.32 on the CNN). The steps are medians of
three held-out seeds on two splits, and the time is the steps times the step's cost
measured side by side in alternated blocks, one thread, every timed step taken from the same
initial weights (a ReLU network's kernels run faster the more of its units an optimizer has
left at zero, and AdamW leaves nearly all of the digits CNN's at zero within five steps).
Muon's iteration runs in float32
(the better of the two Muons on small matrices; a CPU's bf16 products pay only from about
128 wide); SOAP and the shipped Muon ran with the same seeds in an earlier run with every
peer and narrower grids (last column: their steps). Against AdamW and Muon in the same run
the default reaches the target in at most the best peer's time on {time_wins} of
{families} families and in at most the fewest steps on {step_wins} (SOAP takes fewer on the
transformer); its step is within 1.3× AdamW's on {within} (in bold: the step and time
that meet their targets). Muon at its best rate takes fewer
steps than the default on the autoencoder (split 0: {ae_muon_seeds} against the default's
{ae_seeds}) at {ae_muon_step} of its step, and is level with it in time on the CNN: run to
run, a step's ratio moves by about ±10% on this machine. On the MLP and the
autoencoder, whose layers are 16 to 256 wide at batch 256, the products of the
preconditioning alone (the rotations into and out of the bases and the Newton–Schulz steps,
timed apart on tensors of the layers' shapes: `benchmarks/probes/step_anatomy.py`) cost
{mlp_algebra} and {ae_algebra} of AdamW's whole step, so a step that paid nothing else
would already be {mlp_floor}× and {ae_floor}× AdamW's; the host's work around them (Python
and small tensor operations: the statistics, the leftover Adam, the hooks, the checks)
costs {mlp_host} and {ae_host} more. The engine's forms for a launch-bound GPU (one flat
pass over the groups' moments, one batched polar iteration, multi-tensor checks) make the
CPU's step slower, not faster: {mlp_launch}× and {ae_launch}× AdamW's. The GPT is
evaluated every 5 steps: on split 0 its seeds reached the target at {gpt_seeds} steps, so
one seed moving by one evaluation moves the median by 5. On its second split, whose target
takes several times the steps, the rate the sweep chose for the default ({gpt_lr}, the
fastest on the sweep's seed) reached it at {gpt_split1} steps of {max_steps} (–: not
reached), where Muon took {gpt_muon_split1}; at {gpt_early_lr} the default reached it at
{gpt_early_split1} (`benchmarks/results/early_refresh.json`).
By the runs' own clocks instead (split 0, the median over seeds), which include each
optimizer's first steps (K-FAC's first factors and bases) and its own weights, the default
takes at most the best peer's time on {raw_wins} of {families} families: {raw_ratios} of
the best peer's seconds. A run of 5 to 25 steps pays its first basis almost whole.
""",
        tables=(suite_table(SUITE, SUITE_ALL_PEERS),),
        values=_suite_values,
        plot=("suite_gpt.png", plot_suite(SUITE, "gpt")),
    ),
    Section(
        title="The budget's early refresh",
        sources=(EARLY_REFRESH,),
        text="""
Under `for_model`'s overhead budget a basis may be refreshed only every few tens of steps, so
the first step's basis, built from the initial weights' statistics, would precondition the
whole first interval; the budget refreshes it once more at the first factor capture after the
first step's (`dkfac.config.schedules.EarlyRefresh`). `for_model` with that refresh and
without it (the chosen interval alone), from the same seeds, at the default's rate for each
family (the suite's choice; for two MLPs the suite does not have, a deep narrow one of ReLU
layers without normalisation and one with a single wide hidden layer, the best of the suite's
grid on its sweep seed): median steps to the target of seeds 0–2 on each split.
""",
        tables=(_early_table,),
    ),
    Section(
        title="The default past its target",
        sources=(LONG_RUN,),
        text="""
`dkfac bench suite` stops each run at its target. Past it, on the deep narrow MLP of the
section above (ReLU layers without normalisation, the digits to {target}), runs of {steps} steps
from four seeds at the rate the suite's grid gives the default there ({lr_low}) and at twice
that ({lr_high}, still inside the range `for_model`'s docstring gives): at {lr_low} no seed
fell below {low_lowest} once it had reached the target; at {lr_high} every seed reaches the
target and then collapses to chance ({high_final} at the end), its weights' norm
{norm_high} against {norm_low}. The hidden layers' orthogonalised updates keep one length
per unit of lr (`orthogonal_rms`), and no normalisation layer holds this model's scale. A
length that follows the update's own (`orthogonal_rms_power=0.5`) or a shorter one
(`orthogonal_rms=0.75`), a strong decoupled weight decay (`weight_decay=1.0`) and factors
and bases refreshed every few steps (`overhead=None`) do not collapse at {lr_high} (none
below {others_lowest} after the target): the first two were measured as the default and
lost elsewhere (`docs/tried.md`), the decay takes more steps to the target than the default
at {lr_low}, and the fresh statistics pay their whole cost every step. AdamW and Muon do
not collapse at the top of their grids, as the suite builds them: with torch's default
weight decay (`0.01` and `0.1`). With a constant rate, a run several times longer than the
sweep's should take the rate below the sweep's choice, or decay it: the GPT's second split
above and the Llama's below stall at the rate their sweeps chose.
""",
        tables=(_long_run_table,),
        values=_long_run_values,
    ),
    Section(
        title="The default on four families outside the suite",
        sources=(UNSEEN,),
        text="""
The suite's protocol (`dkfac.bench.suite.measure_task`: the same lr grids swept on one seed,
three held-out seeds on two splits, the step's cost in alternated blocks from the same
weights, one thread) on four models of kinds the suite does not hold and none of the
default's choices was measured on: a ConvNeXt-style network (depthwise convolutions,
LayerNorm, pointwise MLPs on channels-last maps), an MLP-Mixer (token mixing across 16 patch
tokens), a residual CNN with GroupNorm, SiLU and biases (digits), and `transformers`'
`LlamaForCausalLM` (RMSNorm, SwiGLU, rotary positions, grouped-query attention, untied
embeddings) on the GPT task's text. Against AdamW and Muon (float32 iteration) the default
takes the fewest steps on the sweep's split on {step_wins} of {families} families and at
most the best peer's time on {time_wins}; its step is within 1.3× AdamW's on {within}. On
the Mixer the sweep's seed picked lr {mixer_lr}, and Muon takes fewer steps. On the Llama's
second split the default at its swept lr {llama_lr} (the top of its grid, tied in steps
with 0.01 on the sweep's seed) reached the target at {llama_dkfac} steps of {max_steps}
(–: not reached; from step 60 on, the loss of those runs stayed between {late_low} and
{late_high} at that constant rate), where
AdamW reached it at {llama_adamw} and Muon at {llama_muon}: with a constant learning rate
and a target that takes several times the steps of the sweep's split, the rate that wins the
sweep is too high for the default there.
""",
        tables=(suite_table(UNSEEN),),
        values=_unseen_values,
    ),
    Section(
        title="The default at a smaller batch",
        sources=(SMALL_BATCH, *SMALL_BATCH_AE.values()),
        text="""
The suite's protocol on its five digits families with {batch} images a step instead of each
task's own (`dkfac bench suite --batch-size {batch}`: the same grids, sweep and held-out
seeds, and timing). Against AdamW and Muon (float32 iteration) the default takes at most the
fewest steps on {step_wins} of {families} families and at most the best peer's time on
{time_wins}; its step is within 1.3× AdamW's on {within} of them, since a smaller batch makes the
forward and backward cheaper and not the preconditioner's work. The autoencoder takes
{ae_dkfac} steps on the sweep's split against Muon's {ae_muon}: at this batch the overhead
budget leaves nearly every side of it one-sided (the identity basis) and its statistics
stale. With every basis kept (`basis_max_dim=4096`) it takes {ae_bases} steps, and with
factors every step and bases at the default's fixed interval (`overhead=None`) {ae_none}, at
the cost of the work the budget left out (their steps were timed in runs of their own, so
not side by side with the peers').
""",
        tables=(suite_table(SMALL_BATCH),),
        values=_small_batch_values,
    ),
    Section(
        title="Wide sides: the statistics K-FAC keeps",
        sources=(WIDE_SIDES,),
        text="""
A side wider than three quarters of the rows a step sees keeps the identity as its basis
under `for_model` (one-sided), and its factor, which nothing reads but its width, is captured and
kept as its diagonal; a side cut into diagonal blocks (`basis_block_size`) keeps only its
blocks. On the probe's MLP, whose input is many times wider than its batch (one thread),
every side but the head's outputs is one-sided: the preconditioner's statistics hold
{mlp_bytes} bytes, where square factors would hold {mlp_dense}, and its step costs
{mlp_ratio}× AdamW's (the median ratio of five rounds of alternated blocks; the rounds
ranged from {mlp_low} to {mlp_high}). The suite's GPT with blocks as wide as the model keeps
{gpt_blocks} bytes of statistics against {gpt_whole} with whole bases.
""",
        values=_wide_values,
        commands=(
            "PYTHONPATH=src python benchmarks/probes/one_sided_memory.py --threads 1 "
            "--blocks 7 --rounds 5 --gpt-steps 3 --label after "
            "--out benchmarks/results/one_sided_memory.json",
        ),
    ),
    Section(
        title="Grouped and depthwise convolutions under the default",
        sources=(GROUPED,),
        text="""
A grouped or depthwise convolution has no Kronecker pair; under `for_model` each output
channel is a unit with its own per-sample Fisher, and its update is Adam's in that Fisher's
eigenbasis (`unitwise_adam`). Against the same default with those convolutions left to Adam's
direction (`skip_layers`), on digits (batch {batch}, to {target} test accuracy), a
ConvNeXt-like model (7×7 depthwise, LayerNorm, pointwise MLP) and a MobileNet-like one
(depthwise-separable blocks with BatchNorm): each arm's lr swept on one seed, then held-out
seeds on the sweep's split and on a second one; the step's cost measured in alternated
blocks, one thread; time × is the default's median steps over both splits times its step,
over the other arm's.
""",
        tables=(_grouped_table,),
        values=lambda p: {"batch": p[GROUPED]["batch"], "target": p[GROUPED]["target"]},
    ),
    Section(
        title="The default on the training program's tasks",
        sources=(*(name for _, name in DEFAULT_TASKS.values()), TTA_TEN_SEEDS),
        text="""
`KFACOptimizer.for_model(model)` as a user gets it, with no recipe, on the three tasks of the
sections below, against AdamW and Muon (float32 iteration) in the same run, medians of three
seeds, one thread: the digits CNN to 97.5% test accuracy (every optimizer's lr swept on one
seed over a grid of the same size), the autoencoder to a training MSE of 0.02 within 20
seconds, and the GPT's validation loss after 60 seconds (on these two the lrs are fixed: the
default's `lr=3e-3`, AdamW's and Muon's from the sweeps of their sections). The default
reaches the CNN's target in {tta_steps} steps ({tta_time}× the fastest peer's time) and the
autoencoder's in {ae_time}× the fastest peer's; on the language model its loss minus the
best peer's is {lm_gap} nats, what the default's loss falls in about {lm_gap_steps} of its
last steps (about {lm_slope} nats a step between its last two evaluations; the runs take
{lm_fewest} to {lm_most} steps in their 60 seconds). Three seeds of a ten-step run move
their median by a seed's step: over {ten_seeds} seeds of the same command the default takes
{ten_steps} steps against Muon's {ten_muon_steps}, at {ten_time}× the fastest peer's time.
""",
        tables=(default_tasks_table(DEFAULT_TASKS),),
        values=_default_task_values,
    ),
    Section(
        title="Time to accuracy: digits CNN",
        sources=tuple(TTA_RUNS.values()),
        text="""
The training program's small CNN on scikit-learn's digits (batch 700), trained until the
test accuracy reaches 97.5%: steps and seconds to the target, medians over 10 seeds, each
optimizer at the best lr of an equal grid swept over three seeds. The dkfac recipe is
`benchmarks/recipes/digits-cnn.toml` (`eigen_adam`, a refresh every 2 steps, factors from 50
samples, a Kronecker-structured basis for the first linear layer); the `for_model` default
is `KFACOptimizer.for_model(model)` as shipped. `torch.optim.Muon` runs its Newton–Schulz
iteration in bf16, which an AVX2 CPU emulates at many times float32's cost; the last run
gives Muon a float32 iteration (`--muon-dtype float32`).
""",
        tables=(peers_table(TTA_RUNS, "tta"),),
        plot=("tta_digits.png", plot_with("tta", TTA_RUNS["AVX-512 CPU, split 0"])),
    ),
    Section(
        title="Time to a training loss: digits autoencoder",
        sources=tuple(AE_RUNS.values()),
        text="""
The deep autoencoder (64-1000-500-250-30, mirrored) on digits, batch 512, trained until the
training MSE reaches 0.02: the exact step and its seconds (an untimed twin run finds the
step), medians over 3 seeds, and the MSE at the 20-second budget. The dkfac recipe is
`benchmarks/recipes/digits-autoencoder.toml` (`eigen_adam` with a three-step orthogonalised
update on the hidden layers and block-diagonal bases).
""",
        tables=(peers_table(AE_RUNS, "autoencoder"),),
        plot=(
            "autoencoder_digits.png",
            plot_with("autoencoder", AE_RUNS["AVX-512 CPU, seeds 0–2"]),
        ),
    ),
    Section(
        title="Language model: byte-level GPT at equal time",
        sources=(*LM_RUNS.values(), LM_PAIRED),
        text="""
The training program's GPT (4 layers, width 128, context 128, batch 32) on the Python
standard library's source: validation loss (nats per byte) after 60 seconds of training,
medians over seeds, the optimizers' steps interleaved so that the machine's drift hits all
alike. The dkfac recipe is `benchmarks/recipes/gpt-text.toml` (`eigen_adam` with Muon's
orthogonalised step on the blocks' matrices, Adam on the embeddings and the head). Muon runs
in float32 on the AVX2 CPU (`--muon-dtype float32`) and as shipped (bf16) on
the AMX CPU. The texts differ between machines, so compare losses within a run.
""",
        tables=(peers_table(LM_RUNS, "lm"), paired_table(LM_PAIRED)),
        notes="""
In the nine-seed run the recipe's median is {nine_recipe} against Muon's {nine_muon}. Over
all {pairs} interleaved seeds of this size the recipe's loss minus Muon's is {mean} nats on
average (standard error {se}), below zero on {below}: level to slightly ahead at equal time,
ahead at equal steps, with a step that costs more than Muon's.
""",
        values=_lm_values,
        plot=("lm_gpt.png", plot_with("lm", LM_RUNS["AVX2 CPU, seeds 150–152"])),
        commands=(
            "dkfac bench paired --first gpt-text --second muon --at-step 75 --seconds 60 "
            "--out benchmarks/results/lm_paired_recipe_muon_60s.json "
            "benchmarks/results/lm_gpt_interleaved_*_seeds*.json",
        ),
    ),
    Section(
        title="Distributed: bytes and memory per rank",
        sources=("comm-cnn.json",),
        text="""
A small CNN (two convolutions with BatchNorm, two linear layers) for three steps under every
strategy on 2 and 4 gloo ranks: the bytes each rank's K-FAC collectives sent (the ledger of
`pre.comm_stats()`) on a step with a basis refresh and on a factor-only step, and the K-FAC
state each rank holds (`pre.memory_usage()`), against the cost model behind `dkfac plan` and
`strategy="auto"`. The last column says whether every rank's ledger and memory equal the
model's prediction byte for byte.
""",
        tables=(comm_table("comm-cnn.json"),),
        plot=("comm_memory.png", plot_comm("comm-cnn.json")),
        commands=("dkfac bench memory",),
    ),
    Section(
        title="Sharded models (FSDP2): memory and bytes per rank",
        sources=(FSDP_MEMORY,),
        text="""
A byte-level GPT (4 blocks of width 64) sharded with `fully_shard` on every block and the
root, on gloo CPU ranks, `KFACOptimizer.for_model` (`eigen_adam`) at fixed intervals:
K-FAC's memory per rank (factors, inverses or bases, moments) under the `replicated` and
`mem-opt` strategies, beside
the model's parameter shard and AdamW's state, and the bytes each rank sends a step (the
layers' gradient rows gathered, factors, inverses and preconditioned gradients; at
`(1, 10)` and `(10, 100)` intervals). Under `mem-opt` the curvature lives only on each
layer's owner. Step times were measured on a shared, loaded machine and are not shown.
""",
        tables=(fsdp_memory_table(FSDP_MEMORY),),
    ),
    Section(
        title="Sharded models (FSDP2): step time against AdamW",
        sources=(FSDP_STEP,),
        text="""
The same GPT under FSDP2 on gloo CPU ranks (one thread each; four ranks share two cores):
AdamW and `KFACOptimizer.for_model` (`mem-opt`, with the owner exchange) interleaved step
by step on the same batch, each step timed as the slowest rank's, means over 100 steps and
medians over three seeds. At `(10, 100)` K-FAC's step costs {r2}× AdamW's on 2 ranks and
{r4}× on 4; the last column is the bytes a step K-FAC's ledger records beside FSDP2's own
parameter all-gathers and gradient reduce-scatter.
""",
        tables=(fsdp_step_table(FSDP_STEP),),
        values=_fsdp_step_values,
    ),
    Section(
        title="Soak: 10,000 steps on 2 ranks",
        sources=tuple(SOAK_RUNS.values()),
        text="""
An MLP on digits, batch 32, on 2 gloo ranks for 10,000 K-FAC steps with every method, a
checkpoint every 500 steps and an evaluation every 250: the resident memory of each rank
after the first 10% of the steps and its growth over the other 90%.
""",
        tables=(soak_table(SOAK_RUNS),),
        plot=("soak.png", plot_soak(SOAK_RUNS)),
    ),
)
"""The results page's sections, in the order they appear."""
