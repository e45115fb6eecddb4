"""The default (``KFACOptimizer.for_model(model, lr=lr)``, nothing else set) against AdamW on
nine model kinds, raced to a held-out target: how many steps each needs.

Kinds (:data:`TASKS`, targets in :data:`TARGETS`):

* ``lstm``, ``gru``: a byte-level language model (embedding 64, one ``nn.LSTM``/``nn.GRU`` of
  width 128, a linear head) on the standard library's source (the first 400 kB, the last
  tenth held out); 32 windows of 64 bytes a step, 200 steps, the validation loss every 10
  steps, to 1.6 (LSTM) and 1.5 (GRU). K-FAC leaves the recurrent layers to its Adam;
* ``convlm``: the same task with causal dilated ``nn.Conv1d`` residual blocks (width 96,
  dilations 1, 2, 4, 8), to 1.5;
* ``unet``: a small U-Net (a strided convolution down, ``nn.ConvTranspose2d`` up, the skip
  concatenated) denoising the digits (noise 0.3), batch 128, 150 steps, the test MSE every 5
  steps, to 0.025;
* ``vae``: a VAE (hidden 256, latent 8; BCE plus KL), batch 128, 200 steps, the test
  negative ELBO every 5 steps, to 25.5;
* ``contrastive``: a SimCLR encoder (two convolutions, a projection head) trained with
  InfoNCE on two augmented views (two forwards through the same encoder), batch 256, 150
  steps, the held-out 5-NN accuracy of its features every 10 steps, to 0.90;
* ``tabular``: 24 pixels as categorical columns (5 levels, one ``nn.Embedding`` each) and
  the other 40 as numeric ones, an MLP, batch 256, 100 steps, test accuracy every step, to
  0.95;
* ``deep_narrow``: a residual MLP of 12 blocks of width 32, and ``wide_shallow``: one hidden
  layer of 1024; the digits, batch 256, 100 steps, test accuracy every step, to 0.95.

Protocol: one thread; for each arm the lr grid :data:`LRS` (weight decay 0, constant lr),
extended by one rate (:data:`EDGES`) where the best rate of an arm sat at the grid's edge;
seeds :data:`SEEDS` (the seed makes the initial weights, the batch generator is seeded
``1000 + seed``). A run's figure is the first evaluated step at which the held-out metric
reaches the target (``None``: not within the run); per arm and lr the steps of each seed and
their median (``None`` unless the median seed reached it). The best lr of an arm is the one
with the lowest median, a seed that did not reach the target counting as 10^9 steps (so a
rate where one seed of two reached it ranks above one where none did), ties broken by the
mean final metric (a run stopped by a non-finite loss has none and ranks last among
equals), the lower rate on a full tie.

The runs of a kind come in passes (:func:`passes`): the grid, then each edge extension;
a pass builds the task once and runs seeds, then arms (``dkfac`` first), then rates in
order, and the digits tasks draw their batches from one epoch sampler per pass, so a run
starts where the previous run of its pass left the epoch. Where the run's steps are a
multiple of the epoch's batches (all but ``unet`` and ``vae``) every run starts a new epoch
and a run alone repeats its figure; for ``unet`` and ``vae`` only the whole pass does.
The text tasks read the running interpreter's standard library, so their data is that of
the Python they run under.

``--time`` adds a rough step-time measurement per kind at the best rates: the median of 6
alternated 10-step blocks, separate models from the same initial weights (rough: one shared
CPU, no warm-up beyond one block).

    PYTHONPATH=src python benchmarks/probes/more_model_kinds.py --threads 1 \\
        --out benchmarks/results/more_model_kinds.json

``--from-runs DIR`` summarises saved runs (``race_<kind>.json`` for the grid and
``race_<kind>_edge*.json`` for the extensions, each ``{"kind", "runs": [...]}`` with the
runs this probe's :func:`train` returns) instead of running them; it checks that they hold
exactly the runs of :func:`passes`.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer
from dkfac.app.data import load_digits
from dkfac.app.text import byte_tensor, default_text_path, read_text_bytes, windows


# ---------------------------------------------------------------- models
class RNNLM(nn.Module):
    def __init__(self, cell: type[nn.Module], width: int = 128, emb: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, emb)
        self.rnn = cell(emb, width, batch_first=True)
        self.head = nn.Linear(width, 256)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(self.emb(x))[0])


class ConvLM(nn.Module):
    """Byte embedding, causal dilated Conv1d residual blocks, linear head."""

    def __init__(
        self, width: int = 96, kernel: int = 3, dilations: tuple[int, ...] = (1, 2, 4, 8)
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, width)
        self.convs = nn.ModuleList(nn.Conv1d(width, width, kernel, dilation=d) for d in dilations)
        self.pads = [(kernel - 1) * d for d in dilations]
        self.head = nn.Linear(width, 256)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x).transpose(1, 2)  # N, C, T
        for conv, pad in zip(self.convs, self.pads, strict=True):
            h = h + F.gelu(conv(F.pad(h, (pad, 0))))
        return self.head(h.transpose(1, 2))


class UNet(nn.Module):
    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.enc1 = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.ReLU()
        )
        self.down = nn.Sequential(nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.ReLU())  # 4x4
        self.mid = nn.Sequential(nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)  # 8x8
        self.dec = nn.Sequential(nn.Conv2d(2 * c, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, 1, 1))

    def forward(self, x: Tensor) -> Tensor:
        e = self.enc1(x)
        m = self.mid(self.down(e))
        return self.dec(torch.cat([self.up(m), e], dim=1))


class VAE(nn.Module):
    def __init__(self, hidden: int = 256, latent: int = 8) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU())
        self.mu = nn.Linear(hidden, latent)
        self.logvar = nn.Linear(hidden, latent)
        self.dec = nn.Sequential(nn.Linear(latent, hidden), nn.ReLU(), nn.Linear(hidden, 64))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.dec(z), mu, logvar


class Encoder(nn.Module):
    def __init__(self, c: int = 32, dim: int = 32) -> None:
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.fc = nn.Linear(2 * c, 64)
        self.proj = nn.Sequential(nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, dim))

    def features(self, x: Tensor) -> Tensor:
        return self.fc(self.convs(x).mean(dim=(2, 3)))

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.features(x))


class Tabular(nn.Module):
    """One nn.Embedding per categorical column, concatenated with the numeric columns, MLP."""

    def __init__(self, n_cat: int, levels: int, n_num: int, emb: int = 4, width: int = 128) -> None:
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(levels, emb) for _ in range(n_cat))
        self.mlp = nn.Sequential(
            nn.Linear(n_cat * emb + n_num, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, 10),
        )

    def forward(self, x: tuple[Tensor, Tensor]) -> Tensor:
        cat, num = x
        parts = [e(cat[:, i]) for i, e in enumerate(self.embs)]
        return self.mlp(torch.cat([*parts, num], dim=1))


class DeepNarrow(nn.Module):
    def __init__(self, depth: int = 12, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(64, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x.flatten(1))
        for b in self.blocks:
            h = h + F.gelu(b(h))
        return self.head(h)


def wide_shallow() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 10))


# ---------------------------------------------------------------- tasks
@dataclass
class Task:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Any]  # -> (inputs, targets)
    loss: Callable[[nn.Module, Any], Tensor]  # training loss of one batch (model called inside)
    metric: Callable[[nn.Module], float]  # held-out, lower is better unless higher
    higher: bool
    steps: int
    eval_every: int
    notes: dict[str, Any] = field(default_factory=dict)


_CACHE: dict[str, Any] = {}


def text(split: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    key = f"text{split}"
    if key not in _CACHE:
        stream = byte_tensor(read_text_bytes(default_text_path(), 400_000))
        cut = len(stream) // 10
        train, held = stream[: len(stream) - cut], stream[len(stream) - cut :]
        xt, yt = windows(train, 64, 1)
        xe, ye = windows(held, 64, 64)
        _CACHE[key] = (xt, yt, xe[:64], ye[:64])
    return _CACHE[key]


def digits(normalize: bool) -> Any:
    key = f"digits{normalize}"
    if key not in _CACHE:
        _CACHE[key] = load_digits(seed=0, normalize=normalize)
    return _CACHE[key]


def _ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def lm_task(name: str, build: Callable[[], nn.Module]) -> Task:
    xt, yt, xe, ye = text()

    def batch(g: torch.Generator) -> Any:
        idx = torch.randint(len(xt), (32,), generator=g)
        return xt[idx], yt[idx]

    def metric(m: nn.Module) -> float:
        with torch.no_grad():
            return float(_ce(m(xe), ye))

    return Task(name, build, batch, lambda m, b: _ce(m(b[0]), b[1]), metric, False, 200, 10)


def _epochs(n: int, bs: int) -> Callable[[torch.Generator], Tensor]:
    state: dict[str, Any] = {"order": None, "at": n}

    def draw(g: torch.Generator) -> Tensor:
        if state["at"] + bs > n:
            state["order"], state["at"] = torch.randperm(n, generator=g), 0
        idx = state["order"][state["at"] : state["at"] + bs]
        state["at"] += bs
        return idx

    return draw


def classify_task(name: str, build: Callable[[], nn.Module], steps: int = 100) -> Task:
    d = digits(True)
    draw = _epochs(len(d.x_train), 256)

    def batch(g: torch.Generator) -> Any:
        idx = draw(g)
        return d.x_train[idx], d.y_train[idx]

    def metric(m: nn.Module) -> float:
        with torch.no_grad():
            return float((m(d.x_test).argmax(-1) == d.y_test).float().mean())

    return Task(name, build, batch, lambda m, b: _ce(m(b[0]), b[1]), metric, True, steps, 1)


def unet_task() -> Task:
    d = digits(False)
    draw = _epochs(len(d.x_train), 128)
    noise_test = torch.randn(d.x_test.shape, generator=torch.Generator().manual_seed(99)) * 0.3

    def batch(g: torch.Generator) -> Any:
        x = d.x_train[draw(g)]
        return x + 0.3 * torch.randn(x.shape, generator=g), x

    def metric(m: nn.Module) -> float:
        with torch.no_grad():
            return float(F.mse_loss(m(d.x_test + noise_test), d.x_test))

    return Task("unet", UNet, batch, lambda m, b: F.mse_loss(m(b[0]), b[1]), metric, False, 150, 5)


def _vae_loss(m: nn.Module, x: Tensor) -> Tensor:
    logits, mu, logvar = m(x)
    rec = F.binary_cross_entropy_with_logits(logits, x.flatten(1), reduction="sum") / len(x)
    kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / len(x)
    return rec + kl


def vae_task() -> Task:
    d = digits(False)
    draw = _epochs(len(d.x_train), 128)

    def batch(g: torch.Generator) -> Any:
        return d.x_train[draw(g)]

    def metric(m: nn.Module) -> float:
        state = torch.get_rng_state()
        torch.manual_seed(123)
        with torch.no_grad():
            value = float(_vae_loss(m, d.x_test))
        torch.set_rng_state(state)
        return value

    return Task("vae", VAE, batch, _vae_loss, metric, False, 200, 5)


def _augment(x: Tensor, g: torch.Generator) -> Tensor:
    """A random shift of up to 1 pixel (pad 1, random 8x8 crop) and pixel noise."""
    n = len(x)
    padded = F.pad(x, (1, 1, 1, 1))
    dx = torch.randint(0, 3, (n,), generator=g)
    dy = torch.randint(0, 3, (n,), generator=g)
    rows = (dy[:, None] + torch.arange(8)[None])[:, :, None].expand(n, 8, 8)
    cols = (dx[:, None] + torch.arange(8)[None])[:, None, :].expand(n, 8, 8)
    out = padded[torch.arange(n)[:, None, None], 0, rows, cols].unsqueeze(1)
    return out + 0.3 * torch.randn(out.shape, generator=g)


def info_nce(z1: Tensor, z2: Tensor, tau: float = 0.2) -> Tensor:
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    sim = z @ z.T / tau
    n = len(z1)
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(sim, target)


def contrastive_task() -> Task:
    d = digits(True)
    draw = _epochs(len(d.x_train), 256)

    def batch(g: torch.Generator) -> Any:
        x = d.x_train[draw(g)]
        return _augment(x, g), _augment(x, g)

    def loss(m: nn.Module, b: Any) -> Tensor:
        return info_nce(m(b[0]), m(b[1]))  # two forwards through the same encoder

    def metric(m: nn.Module) -> float:
        """Held-out k-NN (k=5, cosine) accuracy of the encoder's features."""
        with torch.no_grad():
            tr = F.normalize(m.features(d.x_train), dim=1)
            te = F.normalize(m.features(d.x_test), dim=1)
            nearest = (te @ tr.T).topk(5, dim=1).indices
            votes = d.y_train[nearest].mode(dim=1).values
            return float((votes == d.y_test).float().mean())

    return Task("contrastive", Encoder, batch, loss, metric, True, 150, 10)


def tabular_task() -> Task:
    d = digits(False)
    levels, n_cat = 5, 24
    cat_cols = torch.arange(0, 64, 64 // n_cat)[:n_cat]
    num_cols = torch.tensor([c for c in range(64) if c not in set(cat_cols.tolist())])

    def split(x: Tensor) -> tuple[Tensor, Tensor]:
        flat = x.flatten(1)
        cat = (flat[:, cat_cols] * (levels - 1)).round().long()
        num = flat[:, num_cols]
        return cat, num

    ctr, ntr = split(d.x_train)
    cte, nte = split(d.x_test)
    mean, std = ntr.mean(0), ntr.std(0) + 1e-3
    ntr, nte = (ntr - mean) / std, (nte - mean) / std
    draw = _epochs(len(ctr), 256)

    def batch(g: torch.Generator) -> Any:
        idx = draw(g)
        return (ctr[idx], ntr[idx]), d.y_train[idx]

    def metric(m: nn.Module) -> float:
        with torch.no_grad():
            return float((m((cte, nte)).argmax(-1) == d.y_test).float().mean())

    build = lambda: Tabular(n_cat, levels, len(num_cols))  # noqa: E731
    return Task("tabular", build, batch, lambda m, b: _ce(m(b[0]), b[1]), metric, True, 100, 1)


TASKS: dict[str, Callable[[], Task]] = {
    "lstm": lambda: lm_task("lstm", lambda: RNNLM(nn.LSTM)),
    "gru": lambda: lm_task("gru", lambda: RNNLM(nn.GRU)),
    "convlm": lambda: lm_task("convlm", ConvLM),
    "unet": unet_task,
    "vae": vae_task,
    "contrastive": contrastive_task,
    "tabular": tabular_task,
    "deep_narrow": lambda: classify_task("deep_narrow", DeepNarrow),
    "wide_shallow": lambda: classify_task("wide_shallow", wide_shallow),
}


# ---------------------------------------------------------------- protocol
TARGETS: dict[str, float] = {
    "lstm": 1.6,
    "gru": 1.5,
    "convlm": 1.5,
    "unet": 0.025,
    "vae": 25.5,
    "contrastive": 0.9,
    "tabular": 0.95,
    "deep_narrow": 0.95,
    "wide_shallow": 0.95,
}
"""Kind -> the held-out metric's target (reached at or above it where the task's
``higher`` holds, else at or below)."""

METRICS: dict[str, str] = {
    "lstm": "validation cross-entropy (nats/byte)",
    "gru": "validation cross-entropy (nats/byte)",
    "convlm": "validation cross-entropy (nats/byte)",
    "unet": "test MSE of the denoised digits",
    "vae": "test negative ELBO",
    "contrastive": "held-out 5-NN accuracy of the features",
    "tabular": "test accuracy",
    "deep_narrow": "test accuracy",
    "wide_shallow": "test accuracy",
}

ARMS = ("dkfac", "adamw")
LRS = (3e-3, 1e-2, 3e-2)
SEEDS = (0, 1)
EDGES: dict[str, list[tuple[tuple[str, ...], tuple[float, ...]]]] = {
    "lstm": [(("dkfac",), (6e-2,))],
    "convlm": [(("dkfac",), (1e-3,))],
    "unet": [(("dkfac", "adamw"), (1e-3,))],
    "contrastive": [(("adamw",), (1e-3,))],
    "tabular": [(("adamw",), (6e-2,))],
}
"""Kind -> the extra passes (arms, rates) past the grid's edge where an arm's best sat."""

NOT_REACHED = 10**9
"""The steps a seed that did not reach the target counts as in the ranking."""


def passes(kind: str) -> list[tuple[tuple[str, ...], tuple[float, ...]]]:
    """The passes of a kind: the grid, then its edge extensions."""
    return [(ARMS, LRS), *EDGES.get(kind, [])]


# ---------------------------------------------------------------- running
def make_opt(arm: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW (weight decay 0) or the default K-FAC."""
    if arm == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    return KFACOptimizer.for_model(model, lr=lr)


def train(task: Task, arm: str, lr: float, seed: int) -> dict[str, Any]:
    """One run: the evaluated metric every ``eval_every`` steps and every step's loss."""
    torch.manual_seed(seed)
    model = task.build()
    opt = make_opt(arm, model, lr)
    g = torch.Generator().manual_seed(1000 + seed)
    trace: list[list[float]] = []
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(1, task.steps + 1):
        b = task.batch(g)
        opt.zero_grad(set_to_none=True)
        loss = task.loss(model, b)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            break
        if step % task.eval_every == 0:
            model.eval()
            trace.append([step, task.metric(model)])
            model.train()
    return {
        "arm": arm,
        "lr": lr,
        "seed": seed,
        "trace": trace,
        "losses": losses,
        "seconds": time.perf_counter() - t0,
    }


def run_pass(
    kind: str, arms: tuple[str, ...], lrs: tuple[float, ...], seeds: tuple[int, ...]
) -> list[dict[str, Any]]:
    """The runs of one pass, on one task built for it (see the module doc)."""
    task = TASKS[kind]()
    runs = []
    for seed in seeds:
        for arm in arms:
            for lr in lrs:
                r = train(task, arm, lr, seed)
                runs.append(r)
                last = r["trace"][-1] if r["trace"] else None
                print(f"{kind} {arm:6s} lr={lr:<7g} seed={seed} final={last}", flush=True)
    return runs


def time_arms(
    task: Task, lrs: dict[str, float], blocks: int = 6, per_block: int = 10
) -> dict[str, Any]:
    """Rough step time of each arm: median of alternated blocks (the first one discarded)."""
    torch.manual_seed(0)
    models = {a: task.build() for a in lrs}
    base = copy.deepcopy(models["adamw"].state_dict())
    for m in models.values():
        m.load_state_dict(base)
    opts = {a: make_opt(a, models[a], lr) for a, lr in lrs.items()}
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {a: [] for a in lrs}
    for r in range(blocks + 1):
        for a in lrs:
            t = 0.0
            for _ in range(per_block):
                b = task.batch(g)
                start = time.perf_counter()
                opts[a].zero_grad()
                task.loss(models[a], b).backward()
                opts[a].step()
                t += time.perf_counter() - start
            if r:
                times[a].append(t / per_block)
    med = {a: statistics.median(v) for a, v in times.items()}
    return {"median_step_s": med, "ratio": med["dkfac"] / med["adamw"]}


# ---------------------------------------------------------------- summary
def reached(trace: list[list[float]], target: float, higher: bool) -> int | None:
    """The first evaluated step at which the metric reaches the target."""
    for step, value in trace:
        if (value >= target) if higher else (value <= target):
            return int(step)
    return None


def summarise(kind: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm and lr the steps of each seed to the target, their median; the best lr."""
    task_info = TASKS[kind]()
    target, higher = TARGETS[kind], task_info.higher
    evals = task_info.steps // task_info.eval_every
    arms: dict[str, Any] = {}
    for arm in sorted({r["arm"] for r in runs}, key=ARMS.index):
        by_lr: dict[str, Any] = {}
        best: tuple[tuple[float, float], str] | None = None
        for lr in sorted({r["lr"] for r in runs if r["arm"] == arm}):
            chosen = sorted((r for r in runs if r["arm"] == arm and r["lr"] == lr), key=_seed)
            steps = [reached(r["trace"], target, higher) for r in chosen]
            finals = [r["trace"][-1][1] if len(r["trace"]) == evals else None for r in chosen]
            rank = statistics.median(NOT_REACHED if s is None else s for s in steps)
            median = statistics.median(math.inf if s is None else s for s in steps)
            known = [f for f in finals if f is not None]
            final = statistics.mean(known) if len(known) == len(finals) else None
            by_lr[f"{lr:g}"] = {
                "seeds": [r["seed"] for r in chosen],
                "steps_to_target": steps,
                "median_steps": median if math.isfinite(median) else None,
                "final_metric": [None if f is None else round(f, 5) for f in finals],
            }
            worst = -math.inf if higher else math.inf
            tie = worst if final is None else final
            key = (rank, -tie if higher else tie)
            if best is None or key < best[0]:
                best = (key, f"{lr:g}")
        assert best is not None
        arms[arm] = {"by_lr": by_lr, "best_lr": best[1]}
    return {
        "metric": METRICS[kind],
        "target": target,
        "higher_is_better": higher,
        "steps": task_info.steps,
        "eval_every": task_info.eval_every,
        "arms": arms,
    }


def _seed(run: dict[str, Any]) -> int:
    return int(run["seed"])


def _run_keys(runs: list[dict[str, Any]]) -> list[tuple[str, float, int]]:
    return sorted((r["arm"], r["lr"], r["seed"]) for r in runs)


def load_runs(directory: Path, kind: str) -> list[dict[str, Any]]:
    """The saved runs of a kind's passes; raises if they are not exactly those passes."""
    files = [directory / f"race_{kind}.json", *sorted(directory.glob(f"race_{kind}_edge*.json"))]
    runs: list[dict[str, Any]] = []
    for path in files:
        saved = json.loads(path.read_text())
        if saved["kind"] != kind:
            raise ValueError(f"{path} holds kind {saved['kind']!r}, expected {kind!r}")
        runs += saved["runs"]
    expected = [
        (arm, lr, seed)
        for arms, lrs in passes(kind)
        for arm in arms
        for lr in lrs
        for seed in SEEDS
    ]
    if _run_keys(runs) != sorted(expected):
        raise ValueError(f"the runs of {kind} in {directory} are not those of passes({kind!r})")
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kinds", nargs="+", choices=tuple(TASKS), default=list(TASKS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--from-runs", type=Path, default=None, help="summarise saved runs")
    parser.add_argument(
        "--time", action="store_true", help="add a rough step time at the best rates"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {}
    for kind in args.kinds:
        if args.from_runs is not None:
            runs = load_runs(args.from_runs, kind)
        else:
            runs = [r for arms, lrs in passes(kind) for r in run_pass(kind, arms, lrs, SEEDS)]
        results[kind] = summary = summarise(kind, runs)
        best = {arm: summary["arms"][arm]["best_lr"] for arm in ARMS}
        if args.time:
            summary["step_time_rough"] = time_arms(
                TASKS[kind](), {arm: float(lr) for arm, lr in best.items()}
            )
        shown = "  ".join(
            f"{arm} lr {lr}: {summary['arms'][arm]['by_lr'][lr]['median_steps']}"
            for arm, lr in best.items()
        )
        print(f"{kind:>12} (target {TARGETS[kind]:g}): {shown}", flush=True)
    if args.out is not None:
        record = {
            "command": "PYTHONPATH=src python benchmarks/probes/more_model_kinds.py "
            f"--threads {args.threads} --out {args.out}",
            "seeds": list(SEEDS),
            "figure": "first evaluated step at the held-out target per seed (None: not "
            "reached), median over seeds; best lr per arm by that median",
            "results": results,
        }
        if args.from_runs is not None:
            record["summarised_from_saved_runs"] = True
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
