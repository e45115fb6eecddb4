"""The optimizers ``dkfac bench`` compares K-FAC with, built by name for a model.

Kinds (each run at the learning rate of its grid that the benchmark is sweeping):

* ``sgd``: ``torch.optim.SGD`` with the benchmark's ``--momentum``.
* ``adam``: ``torch.optim.Adam`` (torch's defaults).
* ``adamw``: ``torch.optim.AdamW`` (torch's defaults: betas (0.9, 0.999), weight decay 0.01).
* ``muon``: ``torch.optim.Muon`` (torch's defaults: momentum 0.95, Nesterov, 5 Newton–Schulz
  steps, weight decay 0.1, the "original" lr adjustment) on the hidden weight matrices, and
  ``torch.optim.AdamW`` at ``adamw_lr`` on every other parameter; :func:`muon_split` says
  exactly which parameters go where.
* ``soap``: heavyball's ``SOAP`` (optional, ``pip install 'dkfac[bench]'``) with heavyball's
  defaults (betas (0.9, 0.95), shampoo_beta 0.95, eigenbases refreshed every 2 steps, weight
  decay 0.01), run eagerly like every other optimizer here (heavyball's ``torch.compile``
  would put minutes of compilation into the first timed steps on a CPU).
* ``kfac``: ``KFACOptimizer`` over an inner optimizer, with the preconditioner options of
  the spec (``True`` / ``False`` are read as booleans). The spec keys of
  :data:`KFAC_INNER_OPTIONS` choose the inner optimizer (:func:`kfac_parts`):

  - ``inner=sgd`` (the default): ``torch.optim.SGD(lr, momentum=inner_momentum,
    weight_decay=inner_weight_decay)``, the momentum being the benchmark's when
    ``inner_momentum`` is not given and the decay 0 (e.g. ``method=eigen_adam,
    inner_momentum=0``: the preconditioner is the whole optimizer, the decay is decoupled);
  - ``inner=adamw``: ``torch.optim.AdamW(lr, betas=(inner_momentum, 0.999), eps=1e-8,
    weight_decay=inner_weight_decay)``, with ``inner_momentum`` 0.9 when not given (Adam's
    usual beta1, not the benchmark's SGD momentum) and the decay 0; AdamW's decay is
    decoupled (``dkfac train --optimizer kfac-adam`` uses ``torch.optim.Adam``, whose decay
    is an L2 term in the gradient).

A K-FAC spec's ``overhead`` (:data:`KFAC_BUDGET_OPTION`) gives the preconditioner the overhead
budget ``KFACOptimizer.for_model`` gives it (the factor batch, intervals and Newton–Schulz
steps the spec does not set are chosen within it).

Options of a kind (``--peer-options KIND:key=value,...``) are checked against
:data:`PEER_OPTIONS`; :func:`resolve_options` merges them over :data:`DEFAULT_OPTIONS` so that
every result records what ran.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from dkfac.config import KFACConfig, unknown_options
from dkfac.config.checks import check_range
from dkfac.optimizer import KFACOptimizer
from dkfac.preconditioner import KFACPreconditioner

__all__ = [
    "DEFAULT_OPTIONS",
    "KFAC_INNER_OPTIONS",
    "KINDS",
    "PEER_OPTIONS",
    "MuonSplit",
    "MuonWithAdamW",
    "OptimizerSpec",
    "Stepper",
    "build_optimizer",
    "check_kfac_options",
    "kfac_parts",
    "muon_split",
    "resolve_options",
    "unavailable_reason",
]

KINDS = ("sgd", "adam", "adamw", "muon", "soap", "kfac")
"""Every optimizer kind :func:`build_optimizer` knows."""

PEER_OPTIONS: dict[str, frozenset[str]] = {
    "sgd": frozenset({"weight_decay", "nesterov"}),
    "adam": frozenset({"weight_decay", "eps"}),
    "adamw": frozenset({"weight_decay", "eps"}),
    "muon": frozenset(
        {"weight_decay", "momentum", "nesterov", "ns_steps", "adjust_lr_fn", "flatten_conv"}
        | {"adamw_lr", "adamw_weight_decay"}
    ),
    "soap": frozenset(
        {"weight_decay", "precondition_frequency", "shampoo_beta", "max_precond_dim", "eps"}
    ),
}
"""Kind -> the options ``--peer-options`` may set (K-FAC's are the preconditioner's)."""

KFAC_INNER_OPTIONS = frozenset({"inner", "inner_momentum", "inner_weight_decay"})
"""Keys of a K-FAC spec that set its inner optimizer rather than the preconditioner."""

KFAC_BUDGET_OPTION = "overhead"
"""The key of a K-FAC spec that sets the preconditioner's overhead budget (a number > 0, as
``KFACOptimizer.for_model``'s ``overhead``; absent or ``none``: no budget)."""

KFAC_INNER_KINDS = ("sgd", "adamw")
"""Values of a K-FAC spec's ``inner`` key."""

DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "sgd": {},
    "adam": {},
    "adamw": {"weight_decay": 0.01},
    "muon": {
        "weight_decay": 0.1,
        "momentum": 0.95,
        "nesterov": True,
        "ns_steps": 5,
        "flatten_conv": True,
        "adamw_lr": 1e-3,
        "adamw_weight_decay": 0.01,
    },
    "soap": {},
    "kfac": {},
}
"""Kind -> the options it runs with unless told otherwise (torch's defaults, written out)."""

_HIDDEN_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass
class OptimizerSpec:
    """One optimizer under test.

    Attributes:
        name: Its name in tables and JSON (a kind, or the name given to a K-FAC variant).
        kind: One of :data:`KINDS`.
        lrs: Its learning-rate grid.
        options: Keyword options of the kind (K-FAC: of the preconditioner).
        recipe: For a K-FAC recipe (``dkfac.bench.recipes``): its file, its values and the
            keys the benchmark ignored; ``None`` otherwise.
    """

    name: str
    kind: str
    lrs: list[float]
    options: dict[str, Any] = field(default_factory=dict)
    recipe: dict[str, Any] | None = None


class Stepper(Protocol):
    """What a training loop needs of an optimizer."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients."""

    def step(self) -> object:
        """Takes one step from the current gradients."""


@dataclass(frozen=True)
class MuonSplit:
    """Which parameters (by name) :class:`MuonWithAdamW` gives to Muon and to AdamW."""

    muon: list[str]
    adamw: list[str]


def muon_split(model: nn.Module) -> MuonSplit:
    """Splits ``model``'s trainable parameters between Muon and AdamW, as is standard.

    Muon takes the ``weight`` of every ``nn.Linear`` and ``nn.Conv1d/2d/3d`` except the
    model's input layer and its output head. The head is the last such module in registration
    order (``model.named_modules()``); the input layer is the first such module, unless the
    model has an ``nn.Embedding``: then the embedding is the input layer (a language model's
    token embedding) and every such module but the last is hidden (a transformer's first
    query projection is a hidden matrix like the others). AdamW takes everything else:
    biases, normalisation parameters, embeddings (also a head tied to an embedding), the input
    layer, the head, and any other parameter. A parameter shared by several modules is listed
    once, under its first name.

    Raises:
        ValueError: If no parameter is left for Muon (fewer than three such layers).
    """
    layers = [m for m in model.modules() if isinstance(m, _HIDDEN_TYPES)]
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    embedded = {id(p) for m in embeddings for p in m.parameters()}
    hidden = {id(m.weight) for m in layers[0 if embeddings else 1 : -1]} - embedded
    muon: list[str] = []
    adamw: list[str] = []
    for name, param in model.named_parameters():  # shared parameters come once
        if param.requires_grad:
            (muon if id(param) in hidden else adamw).append(name)
    if not muon:
        raise ValueError(
            f"muon: {type(model).__name__} has no hidden weight matrix (it needs at least three "
            "Linear/Conv layers, or an embedding and two: the input layer and the head go to "
            "AdamW)"
        )
    return MuonSplit(muon, adamw)


class MuonWithAdamW:
    """``torch.optim.Muon`` on the hidden weights of :func:`muon_split`, AdamW on the rest.

    ``torch.optim.Muon`` takes only 2-D parameters. With ``flatten_conv`` a convolution
    weight of shape ``(out, in, *kernel)`` is given to Muon as a 2-D view ``(out, in·prod(kernel))``
    of the same storage (Keller Jordan's convention): its gradient is viewed the same way
    before every step and Muon's in-place update lands in the weight. Without it, convolution
    weights go to AdamW.

    Args:
        model: The model.
        lr: Muon's learning rate.
        options: ``momentum``, ``nesterov``, ``ns_steps``, ``weight_decay``, ``adjust_lr_fn``,
            ``flatten_conv`` (Muon), ``adamw_lr``, ``adamw_weight_decay`` (AdamW); those not
            given take :data:`DEFAULT_OPTIONS`.
    """

    def __init__(self, model: nn.Module, lr: float, options: Mapping[str, Any]) -> None:
        opts = {**DEFAULT_OPTIONS["muon"], **options}
        flatten = bool(opts.pop("flatten_conv"))
        adamw_lr = float(opts.pop("adamw_lr"))
        adamw_decay = float(opts.pop("adamw_weight_decay"))
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        split = muon_split(model)
        matrices = [n for n in split.muon if params[n].ndim == 2 or flatten]
        if not matrices:
            raise ValueError("muon: every hidden weight is a convolution and flatten_conv is off")
        self.split = MuonSplit(matrices, [n for n in params if n not in matrices])
        # (parameter, the 2-D tensor Muon updates: itself, or a view of its storage)
        self._pairs = [(params[n], _as_matrix(params[n])) for n in matrices]
        self.params = list(params.values())
        self.muon = torch.optim.Muon([m for _, m in self._pairs], lr=lr, **opts)
        self.adamw = torch.optim.AdamW(
            [params[n] for n in self.split.adamw], lr=adamw_lr, weight_decay=adamw_decay
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients of every parameter (and of the 2-D views)."""
        for param in self.params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()
        for _, matrix in self._pairs:
            matrix.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One Muon step on the hidden matrices and one AdamW step on the rest."""
        for param, matrix in self._pairs:
            if matrix is not param:
                matrix.grad = None if param.grad is None else param.grad.reshape(matrix.shape)
        self.muon.step()
        self.adamw.step()


def _as_matrix(param: Tensor) -> Tensor:
    """``param`` if 2-D, else a ``(rows, -1)`` view of its storage (a leaf, no autograd)."""
    return param if param.ndim == 2 else param.detach().view(param.shape[0], -1)


def unavailable_reason(kind: str) -> str | None:
    """Why ``kind`` cannot run in this installation (``None`` if it can)."""
    if kind != "soap":
        return None
    try:
        importlib.import_module("heavyball")
    except ImportError as error:
        return f"heavyball is not installed ({error}); pip install 'dkfac[bench]' to add SOAP"
    return None


def resolve_options(kind: str, *layers: Mapping[str, Any] | None) -> dict[str, Any]:
    """The options ``kind`` runs with: :data:`DEFAULT_OPTIONS` updated by each of ``layers``.

    Raises:
        ValueError: For an unknown kind, or an option the kind does not take (K-FAC's options
            are checked by the preconditioner when it is built).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown optimizer kind {kind!r}; choose from {', '.join(KINDS)}")
    options = dict(DEFAULT_OPTIONS[kind])
    for layer in layers:
        options.update(layer or {})
    if kind in PEER_OPTIONS and (bad := sorted(set(options) - PEER_OPTIONS[kind])):
        allowed = ", ".join(sorted(PEER_OPTIONS[kind])) or "none"
        raise ValueError(f"{kind} takes no option {', '.join(bad)}; allowed: {allowed}")
    return options


def build_optimizer(spec: OptimizerSpec, model: nn.Module, lr: float, momentum: float) -> Stepper:
    """The optimizer of ``spec`` over ``model`` at learning rate ``lr``.

    Args:
        spec: Kind and options (see the module docstring for each kind's defaults).
        model: The freshly built model.
        lr: The learning rate (Muon's for ``muon``; its AdamW part uses ``adamw_lr``).
        momentum: SGD's momentum (for ``sgd``, and the SGD inside ``kfac`` when the spec has
            no ``inner_momentum``).

    Raises:
        ValueError: For an unknown kind or option.
        ImportError: For ``soap`` without heavyball (check :func:`unavailable_reason` first).
    """
    opts = resolve_options(spec.kind, spec.options)
    params = [p for p in model.parameters() if p.requires_grad]
    if spec.kind == "adam":
        return torch.optim.Adam(params, lr=lr, **opts)
    if spec.kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, **opts)
    if spec.kind == "muon":
        return MuonWithAdamW(model, lr, opts)
    if spec.kind == "soap":
        return _soap(params, lr, opts)
    if spec.kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, **opts)
    inner, options = kfac_parts(opts)
    overhead = options.pop(KFAC_BUDGET_OPTION, None)
    optimizer: torch.optim.Optimizer
    if inner["inner"] == "adamw":
        beta1 = float(inner.get("inner_momentum", 0.9))
        decay = float(inner.get("inner_weight_decay", 0.0))
        optimizer = torch.optim.AdamW(params, lr=lr, betas=(beta1, 0.999), weight_decay=decay)
    else:
        optimizer = torch.optim.SGD(
            params,
            lr=lr,
            momentum=float(inner.get("inner_momentum", momentum)),
            weight_decay=float(inner.get("inner_weight_decay", 0.0)),
        )
    return KFACOptimizer(optimizer, KFACPreconditioner(model, lr=lr, overhead=overhead, **options))


def kfac_parts(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Splits a K-FAC spec's options into its inner optimizer's and the preconditioner's.

    Returns:
        ``(inner, preconditioner)``: ``inner`` holds the keys of :data:`KFAC_INNER_OPTIONS`
        that were given, with ``inner`` always set (``"sgd"`` by default); the preconditioner's
        options have ``"True"`` / ``"False"`` strings read as booleans.

    Raises:
        ValueError: For an unknown ``inner_*`` key, an ``inner`` outside
            :data:`KFAC_INNER_KINDS`, a momentum outside [0, 1) or a negative weight decay.
    """
    inner = {k: v for k, v in options.items() if k == "inner" or k.startswith("inner_")}
    if bad := sorted(set(inner) - KFAC_INNER_OPTIONS):
        allowed = ", ".join(sorted(KFAC_INNER_OPTIONS))
        raise ValueError(f"kfac takes no option {', '.join(bad)}; inner ones: {allowed}")
    inner.setdefault("inner", "sgd")
    if inner["inner"] not in KFAC_INNER_KINDS:
        raise ValueError(
            f"kfac option inner must be {' or '.join(KFAC_INNER_KINDS)}, got {inner['inner']!r}"
        )
    for key, low, high in (("inner_momentum", 0.0, 1.0), ("inner_weight_decay", 0.0, math.inf)):
        value = inner.get(key, low)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not low <= value < high
        ):
            shown = "[0, 1)" if high == 1.0 else ">= 0"
            raise ValueError(f"kfac option {key} must be a number in {shown}, got {value!r}")
    rest = {k: v for k, v in options.items() if k not in inner}
    flags = {key: value == "True" for key, value in rest.items() if value in ("True", "False")}
    return inner, {**rest, **flags}


def check_kfac_options(options: Mapping[str, Any]) -> None:
    """Checks a K-FAC spec's options as :func:`build_optimizer` will use them, before any run.

    Raises:
        ValueError: For a bad inner option (:func:`kfac_parts`) or a preconditioner option
            that :class:`~dkfac.KFACConfig` refuses (an unknown name, a value outside its
            domain); the message is one line.
    """
    _, preconditioner = kfac_parts(options)
    overhead = preconditioner.pop(KFAC_BUDGET_OPTION, None)
    if "lr" in preconditioner:  # build_optimizer gives the preconditioner the run's rate
        raise ValueError("kfac option: lr is the run's (--kfac-lrs), not a spec option")
    if problem := unknown_options(preconditioner):
        raise ValueError(f"kfac option: {problem}")
    try:
        if overhead is not None:
            check_range(KFAC_BUDGET_OPTION, overhead, low=0.0)
        KFACConfig(**preconditioner)
    except (TypeError, ValueError) as error:
        raise ValueError(f"kfac option: {error}") from None


def _soap(params: Iterable[Tensor], lr: float, options: Mapping[str, Any]) -> Stepper:
    """heavyball's SOAP over ``params``, eager (heavyball's compilation switched off)."""
    heavyball = importlib.import_module("heavyball")
    heavyball.utils.compile_mode = None
    optimizer: Stepper = heavyball.SOAP(params, lr=lr, **options)
    return optimizer
