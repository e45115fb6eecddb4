"""K-FAC recipes in ``dkfac bench`` (bench/recipes.py): the file -> spec rules, the errors,
the same file in ``dkfac train --config``, and tiny real runs through ``--recipe``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dkfac import KFACOptimizer
from dkfac.app.cli import build_parser, parse_args
from dkfac.app.cli_checks import DEFAULT_LRS
from dkfac.app.gpt import GPT
from dkfac.app.models import DeepAutoencoder, build_model
from dkfac.bench import tta
from dkfac.bench.peers import OptimizerSpec, build_optimizer
from dkfac.bench.recipes import (
    INERT_KEYS,
    OPTIMIZER_KEYS,
    TASK_KEYS,
    kfac_keys,
    load_recipe,
    recipe_grid,
)

CNN_RECIPE = """\
# a K-FAC recipe for the digits CNN
data = "digits"
model = "cnn"
batch-size = 700
epochs = 3
seed = 4
optimizer = "kfac"
lr = 0.3
momentum = 0.8
weight-decay = 1e-4
schedule = "constant"
method = "cholesky"
damping = 0.03
kl-clip = "none"
factor_update_interval = 5
unitwise-bn = false
capture-dtype = "bfloat16"
skip-layers = ["head"]
label-smoothing = 0.0
"""


def _write(folder: Path, text: str, name: str = "digits-cnn.toml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_recipe_grid_doubles_around_the_recipe_lr() -> None:
    assert recipe_grid(0.1, 1) == [0.1]
    assert recipe_grid(0.1, 3) == [0.05, 0.1, 0.2]
    assert recipe_grid(0.1, 4) == [0.025, 0.05, 0.1, 0.2]
    assert recipe_grid(0.1, 5) == [0.025, 0.05, 0.1, 0.2, 0.4]
    with pytest.raises(ValueError, match="at least one rate"):
        recipe_grid(0.1, 0)


def test_a_kfac_recipe_becomes_one_spec_named_after_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, CNN_RECIPE)
    recipe = load_recipe(path)
    spec = recipe.spec(3)
    assert (spec.name, spec.kind, spec.lrs) == ("digits-cnn", "kfac", [0.15, 0.3, 0.6])
    assert recipe.spec(3, sweep=False).lrs == [0.3]
    assert spec.options == {
        "inner": "sgd",
        "inner_momentum": 0.8,
        "inner_weight_decay": 1e-4,
        "capture_dtype": torch.bfloat16,  # typed as the flag parses it
        "damping": 0.03,
        "factor_update_interval": 5,
        "kl_clip": None,  # "none" is None
        "method": "cholesky",
        "unitwise_bn": False,  # booleans stay booleans
        "skip_layers": ("head",),
    }
    assert spec.recipe is not None
    assert spec.recipe["path"] == str(path)
    assert spec.recipe["ignored"] == ["batch_size", "data", "epochs", "model", "seed"]
    assert spec.recipe["values"]["batch_size"] == 700 and spec.recipe["values"]["kl_clip"] == "none"
    optimizer = build_optimizer(spec, nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), 0.3, 0.0)
    assert isinstance(optimizer, KFACOptimizer) and type(optimizer.inner) is torch.optim.SGD
    group = optimizer.inner.param_groups[0]
    assert (group["momentum"], group["weight_decay"]) == (0.8, 1e-4)
    config = optimizer.preconditioner.config
    assert (config.method, config.kl_clip, config.factor_update_interval) == ("cholesky", None, 5)


def test_the_same_file_loads_in_dkfac_train(tmp_path: Path) -> None:
    args = parse_args(["train", "--config", str(_write(tmp_path, CNN_RECIPE))])
    assert (args.optimizer, args.lr, args.method, args.schedule) == (
        "kfac",
        0.3,
        "cholesky",
        "constant",
    )


def test_kfac_adam_runs_over_adamw_with_the_recipe_beta1_and_decay(tmp_path: Path) -> None:
    text = 'optimizer = "kfac-adam"\nlr = 0.002\nmomentum = 0.85\nweight-decay = 0.1\n'
    path = _write(tmp_path, text + 'schedule = "constant"\nloss-average = "positions"\n', "lm.toml")
    spec = load_recipe(path).spec(1)
    assert spec.options == {
        "inner": "adamw",
        "inner_momentum": 0.85,
        "inner_weight_decay": 0.1,
        "loss_average": "positions",
    }
    optimizer = build_optimizer(spec, nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), 0.002, 0.9)
    assert isinstance(optimizer, KFACOptimizer) and type(optimizer.inner) is torch.optim.AdamW
    group = optimizer.inner.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (0.002, (0.85, 0.999), 0.1)


def test_absent_keys_take_dkfac_trains_defaults(tmp_path: Path) -> None:
    recipe = load_recipe(_write(tmp_path, 'schedule = "constant"\n', "bare.toml"))
    train = build_parser()[1]["train"]
    assert recipe.lr == DEFAULT_LRS["kfac"] == 0.05  # dkfac train --optimizer kfac's
    assert recipe.options == {
        "inner": "sgd",  # a recipe names no optimizer: K-FAC under SGD
        "inner_momentum": train.get_default("momentum"),
        "inner_weight_decay": train.get_default("weight_decay"),
    }
    assert recipe.ignored == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('optimizer = "adamw"\nschedule = "constant"', "optimizer 'adamw' is not K-FAC"),
        ("lr = 0.1", "schedule is 'cosine' (dkfac train's default: the file sets none)"),
        (
            'schedule = "cosine"',
            "schedule is 'cosine'; the benchmarks run a constant lr: set schedule = \"constant\"",
        ),
        (
            'schedule = "constant"\ndamping-schedule = "1e-2@0"',
            "damping_schedule: the benchmarks run constant options",
        ),
        (
            'schedule = "constant"\nnesterov = true',
            "nesterov = true: the benchmark's inner SGD has no Nesterov",
        ),
        (
            'schedule = "constant"\nlabel-smoothing = 0.1',
            "label_smoothing = 0.1: the benchmarks do not implement it",
        ),
        ('schedule = "constant"\namp = "bf16"', "amp = 'bf16': the benchmarks do not implement it"),
        ('schedule = "constant"\nfoo = 1', "foo cannot be in a recipe; allowed: lr, momentum, "),
        ('schedule = "constant"\nconfig = "x.toml"', "config cannot be in a recipe"),
        ('schedule = "constant"\ndamping = "x"', "damping must be a number, got 'x'"),
        (
            'schedule = "constant"\nmethod = "nope"',
            "argument --method/--kfac-method: invalid choice: 'nope'",
        ),
        ('schedule = "constant"\ndamping = -1.0', "invalid K-FAC option: damping"),
        ("[kfac]\ndamping = 1.0", "tables are not supported"),
    ],
)
def test_a_recipe_that_breaks_a_rule_is_refused_in_one_line(
    tmp_path: Path, text: str, message: str
) -> None:
    path = _write(tmp_path, text + "\n", "bad.toml")
    with pytest.raises(ValueError) as info:
        load_recipe(path)
    assert message in str(info.value), str(info.value)
    assert str(info.value).startswith(f"--recipe {path}: ") and "\n" not in str(info.value)


def test_a_missing_recipe_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config file .*nope\.toml does not exist"):
        load_recipe(tmp_path / "nope.toml")


def test_every_training_flag_has_a_recipe_rule() -> None:
    """A training flag added later must be sorted into a rule (until then it is refused)."""
    train = build_parser()[1]["train"]
    flags = {a.dest for a in train._actions if a.option_strings and a.dest != "help"}
    schedules = {f for f in flags if f.endswith("_schedule")}
    ruled = OPTIMIZER_KEYS | kfac_keys() | TASK_KEYS | INERT_KEYS
    assert ruled | schedules | {"config"} == flags
    assert not OPTIMIZER_KEYS & TASK_KEYS and not INERT_KEYS & (OPTIMIZER_KEYS | TASK_KEYS)
    assert {"lr", "seed", "accumulation_steps"}.isdisjoint(kfac_keys())


def _tta(tmp_path: Path, *flags: str) -> dict[str, Any]:
    argv = ["--seeds", "1", "--max-steps", "1", "--batch-size", "64"]
    assert tta.main([*argv, "--name", "t", "--out-dir", str(tmp_path), *flags]) == 0
    payload: dict[str, Any] = json.loads((tmp_path / "t.json").read_text())
    return payload


def test_recipes_join_the_kfac_kind_of_tta_and_run(tmp_path: Path) -> None:
    cnn = _write(tmp_path, CNN_RECIPE.replace('capture-dtype = "bfloat16"\n', ""))
    mc = _write(tmp_path, 'schedule = "constant"\nfisher = "mc"\nlr = 0.1\n', "mc.toml")
    flags = ["--optimizers", "sgd", "kfac", "--no-sweep", "--recipe", str(cnn), "--recipe", str(mc)]
    payload = _tta(tmp_path, *flags)
    # the recipes replace tta's default K-FAC variants, as --kfac would
    assert list(payload["runs"]) == ["sgd", "digits-cnn", "mc"]
    specs = {s["name"]: s for s in payload["settings"]["specs"]}
    assert specs["digits-cnn"]["recipe"]["ignored"] == [
        "batch_size",
        "data",
        "epochs",
        "model",
        "seed",
    ]
    assert specs["mc"]["options"]["fisher"] == "mc" and specs["sgd"]["recipe"] is None
    assert [r["steps"] for name in ("digits-cnn", "mc") for r in payload["runs"][name]] == [1, 1]
    assert payload["summary"]["digits-cnn"]["lr"] == 0.3 and payload["summary"]["mc"]["lr"] == 0.1


def test_a_recipe_grid_matches_the_other_grids(tmp_path: Path) -> None:
    parser = tta.argparse.ArgumentParser()
    tta.add_arguments(parser)
    args = parser.parse_args(
        ["--recipe", str(_write(tmp_path, CNN_RECIPE)), "--kfac", "k:damping=1"]
    )
    specs = {s.name: s for s in tta.build_specs(args, tta.DEFAULT_KFAC, tta.TASK_OPTIONS)}
    assert list(specs) == ["sgd", "adamw", "muon", "soap", "k", "digits-cnn"]
    assert specs["digits-cnn"].lrs == [0.075, 0.15, 0.3, 0.6]  # four, like every tta grid
    assert isinstance(specs["k"], OptimizerSpec) and specs["k"].recipe is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--optimizers", "sgd"], "--recipe adds a K-FAC variant: keep kfac among --optimizers"),
        (["--kfac", "digits-cnn:damping=1"], "optimizer names must be unique"),
    ],
)
def test_tta_refuses_a_misplaced_recipe_in_one_line(
    tmp_path: Path, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = _write(tmp_path, CNN_RECIPE)
    with pytest.raises(SystemExit) as exit_info:
        tta.main(["--recipe", str(recipe), *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("dkfac bench tta: error:")


def test_tta_refuses_a_bad_recipe_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = _write(tmp_path, 'optimizer = "sgd"\nschedule = "constant"\n', "sgd.toml")
    with pytest.raises(SystemExit) as exit_info:
        tta.main(["--recipe", str(recipe)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"dkfac bench tta: error: --recipe {recipe}: optimizer 'sgd' is not K-FAC; a recipe's "
        "optimizer is kfac or kfac-adam"
    )


RECIPES = sorted((Path(__file__).parents[2] / "benchmarks" / "recipes").glob("*.toml"))


def _task(stem: str) -> tuple[nn.Module, Tensor, Callable[[Tensor], Tensor]]:
    """A small model with the layer names the recipe's options name, a batch, its loss."""
    if stem == "digits-cnn":  # flattened_inputs names the CNN's first Linear
        y = torch.randint(0, 3, (16,))
        model: nn.Module = build_model("cnn", in_channels=1, image_size=8, num_classes=3)
        return model, torch.randn(16, 1, 8, 8), lambda out: F.cross_entropy(out, y)
    if stem == "digits-autoencoder":  # orthogonal_layers names its hidden layers
        x = torch.randn(16, 12)
        return DeepAutoencoder(12, (10, 8, 6, 3)), x, lambda out: F.mse_loss(out, x)
    if stem == "gpt-text":  # orthogonal_layers names the transformer blocks
        ids = torch.randint(0, 16, (4, 8))
        model = GPT(vocab_size=16, context=8, layers=1, width=8, heads=2)
        return model, ids, lambda out: F.cross_entropy(out.flatten(0, 1), ids.flatten())
    y = torch.randint(0, 3, (16,))
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    return model, torch.randn(16, 4), lambda out: F.cross_entropy(out, y)


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_committed_recipe_loads_in_bench_and_train_and_builds(path: Path) -> None:
    """The files BENCHMARKS.md measures: valid for `dkfac bench` and `dkfac train --config`,
    and one step of each on a small model of its task changes every parameter."""
    recipe = load_recipe(path)
    args = parse_args(["train", "--config", str(path)])
    assert (args.optimizer, args.lr, args.method) == ("kfac", recipe.lr, "eigen_adam")
    assert recipe.options["method"] == "eigen_adam"
    model, x, loss_fn = _task(path.stem)
    optimizer = build_optimizer(recipe.spec(4), model, recipe.lr, 0.9)
    assert isinstance(optimizer, KFACOptimizer)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    loss_fn(model(x)).backward()
    optimizer.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_committed_recipes_are_found() -> None:
    assert {p.stem for p in RECIPES} >= {"digits-cnn", "digits-autoencoder", "gpt-text"}
