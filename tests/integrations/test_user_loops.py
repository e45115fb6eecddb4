"""The default (``KFACOptimizer.for_model``) under what users' training code does around it,
each against the same run without it (the oracle): activation checkpointing
(``torch.utils.checkpoint``, reentrant or not, whose backward runs the forward again), a
``channels_last`` model and inputs, validation passes between steps, ``torch.func``
forwards with other weights (per-sample gradients), and a learning-rate scheduler that
cycles the momentum (``OneCycleLR``)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dkfac import KFACOptimizer, KFACPreconditioner
from tests.integrations.twins import max_difference

DT = torch.float64


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class _Residual(nn.Module):
    """Three residual blocks, each run through ``checkpoint`` (``reentrant`` True or False)
    or plainly (``None``)."""

    def __init__(self, reentrant: bool | None = None, width: int = 8) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(5, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(3))
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = (
                block(h)
                if self.reentrant is None
                else checkpoint(block, h, use_reentrant=self.reentrant)
            )
        return self.head(h)


def _vectors(step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, 5, generator=gen, dtype=DT), torch.randint(0, 3, (16,), generator=gen)


def _run(model: nn.Module, opt: KFACOptimizer, steps: range, batch=_vectors) -> None:
    for step in steps:
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _factors(opt: KFACOptimizer) -> dict[str, tuple[Tensor | None, Tensor | None]]:
    return {name: (layer.a, layer.g) for name, layer in opt.preconditioner.layers.items()}


def _assert_same_factors(a: KFACOptimizer, b: KFACOptimizer, atol: float = 0.0) -> None:
    first, second = _factors(a), _factors(b)
    assert first.keys() == second.keys()
    for name, pair in first.items():
        for x, y in zip(pair, second[name], strict=True):
            assert (x is None) == (y is None), name
            if x is not None:
                assert y is not None
                torch.testing.assert_close(x, y, rtol=0.0, atol=atol, msg=name)


@pytest.mark.parametrize("overhead", [None, 0.3])
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks_capture_once_as_the_plain_model_does(
    reentrant: bool, overhead: float | None
) -> None:
    """The recomputation inside the backward is captured once, on the batch's scale: the
    factors and the weights after 4 steps (factors every step, or as the overhead budget
    chooses: the same choice) equal the plain model's."""
    torch.manual_seed(0)
    plain = _Residual().to(DT)
    twin = _Residual(reentrant).to(DT)
    twin.load_state_dict(plain.state_dict())
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        opts = [KFACOptimizer.for_model(m, lr=0.01, overhead=overhead) for m in (plain, twin)]
    assert not shown  # tracing the checkpointed forward (on proxies) warns nothing
    for model, opt in zip((plain, twin), opts, strict=True):
        _run(model, opt, range(4))
    _assert_same_factors(*opts)
    assert max_difference(plain, twin) == 0.0
    assert opts[0].preconditioner.describe() == opts[1].preconditioner.describe()


class _SharedBlocks(nn.Module):
    """One block applied three times (weights shared across depth, as ALBERT's layers),
    each application run through ``checkpoint`` (``reentrant`` True or False) or plainly."""

    def __init__(self, reentrant: bool | None = None, width: int = 8) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(5, width)
        self.block = _Block(width)
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for _ in range(3):
            h = (
                self.block(h)
                if self.reentrant is None
                else checkpoint(self.block, h, use_reentrant=self.reentrant)
            )
        return self.head(h)


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("method", ["eigen", None])
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_block_shared_by_checkpointed_segments_is_one_backward_pass(
    reentrant: bool, method: str | None, micro_batches: int
) -> None:
    """A reentrant checkpoint runs a backward of its own for each segment: a layer in
    three of them still saw one backward pass per micro-batch, so its G is on the plain
    model's scale (not 3² times it) and the weights after 4 steps are the plain model's
    (``method="eigen"`` under SGD, and the default)."""
    torch.manual_seed(0)
    plain = _SharedBlocks().to(DT)
    twin = _SharedBlocks(reentrant).to(DT)
    twin.load_state_dict(plain.state_dict())
    opts = [
        KFACOptimizer.for_model(m, lr=0.01)
        if method is None
        else KFACOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.05), KFACPreconditioner(m, method=method)
        )
        for m in (plain, twin)
    ]
    for model, opt in zip((plain, twin), opts, strict=True):
        for step in range(4):
            x, y = _vectors(step)
            opt.zero_grad()
            for part_x, part_y in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
                (F.cross_entropy(model(part_x), part_y) / micro_batches).backward()
            opt.step()
    _assert_same_factors(*opts, atol=1e-12)
    assert max_difference(plain, twin) < 1e-12


class _OddConvs(nn.Module):
    """Non-square kernels, ``padding="same"``, reflect and replicate padding, dilation,
    stride 2, BatchNorm, and a head reading the flattened map."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, (1, 3), padding="same")
        self.wide = nn.Conv2d(4, 4, (3, 1), dilation=2, padding="same", padding_mode="reflect")
        self.down = nn.Conv2d(4, 6, (3, 2), stride=2, padding=(1, 0))
        self.norm = nn.BatchNorm2d(6)
        self.last = nn.Conv2d(6, 6, 3, stride=2, dilation=(1, 2), padding=(1, 2),
                              padding_mode="replicate")  # fmt: skip
        self.head = nn.Linear(6 * 2 * 2, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.wide(F.relu(self.stem(x))))
        x = F.relu(self.last(F.relu(self.norm(self.down(x)))))
        return self.head(x.flatten(1))


def test_a_channels_last_model_equals_the_contiguous_one() -> None:
    def images(memory: torch.memory_format):
        def batch(step: int) -> tuple[Tensor, Tensor]:
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(8, 3, 7, 7, generator=gen, dtype=DT)
            return x.contiguous(memory_format=memory), torch.randint(0, 3, (8,), generator=gen)

        return batch

    torch.manual_seed(0)
    plain = _OddConvs().to(DT)
    twin = _OddConvs().to(DT).to(memory_format=torch.channels_last)
    twin.load_state_dict(plain.state_dict())
    assert twin.wide.weight.is_contiguous(memory_format=torch.channels_last)
    opts = [KFACOptimizer.for_model(m, lr=0.01, overhead=None) for m in (plain, twin)]
    for model, opt, memory in zip(
        (plain, twin), opts, (torch.contiguous_format, torch.channels_last), strict=True
    ):
        _run(model, opt, range(3), images(memory))
    _assert_same_factors(*opts, atol=1e-12)
    assert max_difference(plain, twin) < 1e-10
    assert opts[1].preconditioner.config.flattened_inputs == {"head": (6, 4)}


def test_validation_passes_between_steps_capture_nothing() -> None:
    """``model.eval()`` and ``torch.no_grad()`` forwards (and a train-mode forward under
    ``no_grad``, and an eval-mode one with gradients) between steps change nothing."""
    torch.manual_seed(0)
    plain, twin = _Residual().to(DT), _Residual().to(DT)
    twin.load_state_dict(plain.state_dict())
    opts = [KFACOptimizer.for_model(m, lr=0.01, overhead=None) for m in (plain, twin)]
    held_out = _vectors(99)[0]
    for step in range(4):
        _run(plain, opts[0], range(step, step + 1))
        _run(twin, opts[1], range(step, step + 1))
        twin.eval()
        with torch.no_grad():
            twin(held_out)
        twin(held_out).sum()  # a metric forward with gradients, never backpropagated
        twin.train()
        with torch.no_grad():
            twin(held_out[:3])
    _assert_same_factors(*opts)
    assert max_difference(plain, twin) == 0.0


def _per_sample_gradients(model: nn.Module, params: dict[str, Tensor], x: Tensor, y: Tensor):
    """Each sample's gradient, by ``torch.func`` (``vmap`` of ``grad`` of a
    ``functional_call``), as differential privacy or a gradient-noise estimate takes it."""

    def loss(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return F.cross_entropy(torch.func.functional_call(model, p, (xi[None],)), yi[None])

    return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)


@pytest.mark.parametrize("kind", ["per-sample-gradients", "other-weights-backpropagated"])
def test_functional_forwards_with_other_weights_capture_nothing(kind: str) -> None:
    """Forwards of the hooked model that are not its training forward, between steps:
    ``vmap(grad(functional_call(...)))`` (its captures outlived the transform, and the next
    backward raised "your tensor may have escaped from inside a function being vmapped"),
    and ``functional_call`` with other tensors as weights, backpropagated into them (a
    teacher's, an inner loop's: it added another network's statistics and counted as a
    micro-batch). Oracle: the run without them, bit for bit."""
    torch.manual_seed(0)
    plain, twin = _Residual().to(DT), _Residual().to(DT)
    twin.load_state_dict(plain.state_dict())
    opts = [KFACOptimizer.for_model(m, lr=0.01, overhead=None) for m in (plain, twin)]
    for step in range(4):
        _run(plain, opts[0], range(step, step + 1))
        other = {k: 2 * v.detach() for k, v in twin.named_parameters()}
        other = {k: v.requires_grad_() for k, v in other.items()}
        opts[1].zero_grad()
        x, y = _vectors(50 + step)
        if kind == "per-sample-gradients":
            grads = _per_sample_gradients(twin, other, x, y)
            assert grads["head.weight"].shape == (16, 3, 8)
        else:
            F.cross_entropy(torch.func.functional_call(twin, other, (x,)), y).backward()
            assert other["head.weight"].grad is not None
        x, y = _vectors(step)
        F.cross_entropy(twin(x), y).backward()
        opts[1].step()
    _assert_same_factors(*opts)
    assert max_difference(plain, twin) == 0.0


def _cycled(model: nn.Module, momentum: float | None, steps: int = 5, **options) -> KFACOptimizer:
    """``steps`` steps of the default under ``OneCycleLR`` cycling its momentum between
    ``momentum`` and itself (``None``: not cycling it)."""
    opt = KFACOptimizer.for_model(model, lr=0.01, overhead=None, **options)
    cycled = {"base_momentum": momentum, "max_momentum": momentum} if momentum else {}
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.01, total_steps=steps, cycle_momentum=momentum is not None, **cycled
    )
    for step in range(steps):
        _run(model, opt, range(step, step + 1))
        scheduler.step()
    return opt


def test_a_scheduler_cycling_the_momentum_cycles_the_first_moments_beta() -> None:
    """``OneCycleLR`` (momentum cycled by default) set the inner SGD's momentum to 0.95 on
    top of the first moment the update already has (a step up to 20 times as large); it now
    sets the moments' β₁, as it sets AdamW's: cycling 0.8 between 0.8 and 0.8 is
    ``moment_beta1=0.8``, to the bit."""
    torch.manual_seed(0)
    models = [_Residual().to(DT) for _ in range(3)]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    by_scheduler = _cycled(models[0], 0.8)
    by_option = _cycled(models[1], None, moment_beta1=0.8)
    unchanged = _cycled(models[2], None)
    assert max_difference(models[0], models[1]) == 0.0
    assert max_difference(models[0], models[2]) > 1e-6  # β₁ 0.8 is not the default's 0.9
    assert by_scheduler.param_groups[0]["momentum"] == 0.0
    assert by_scheduler.param_groups[0]["betas"] == (
        0.8,
        by_option.preconditioner.config.moment_beta2,
    )
    assert unchanged.param_groups[0]["betas"] == (0.9, 0.95)


def test_one_cycle_with_its_defaults_trains_and_resumes_bit_for_bit() -> None:
    """Its β₁ moves every step (0.95 down to 0.85 and back): the checkpoint holds it (in the
    groups' ``"betas"``) and the resumed run equals the one that did not stop."""

    def start() -> tuple[nn.Module, KFACOptimizer, torch.optim.lr_scheduler.OneCycleLR]:
        torch.manual_seed(0)
        model = _Residual().to(DT)
        opt = KFACOptimizer.for_model(model, lr=0.01)
        return model, opt, torch.optim.lr_scheduler.OneCycleLR(opt, 0.01, total_steps=10)

    def steps(model, opt, scheduler, span: range) -> None:
        for step in span:
            beta1 = opt.param_groups[0]["betas"][0]
            _run(model, opt, range(step, step + 1))
            scheduler.step()
            for solver in (opt.preconditioner.layers["blocks.0.up"].solver, leftover(opt)):
                assert solver.options.beta1 == beta1

    def leftover(opt: KFACOptimizer) -> object:
        assert opt.preconditioner.leftover is not None  # the LayerNorms' Adam
        return opt.preconditioner.leftover.solver

    model, opt, scheduler = start()
    steps(model, opt, scheduler, range(4))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), scheduler.state_dict()))
    steps(model, opt, scheduler, range(4, 9))
    twin, twin_opt, twin_scheduler = start()
    twin.load_state_dict(saved[0])
    twin_opt.load_state_dict(saved[1])
    twin_scheduler.load_state_dict(saved[2])
    steps(twin, twin_opt, twin_scheduler, range(4, 9))
    assert max_difference(model, twin) == 0.0
    assert opt.param_groups[0]["momentum"] == 0.0


def _mlp() -> nn.Sequential:
    """Input, hidden and output Linear layers between tanh (float32): its gradients are the
    same whether the backward runs inside an autocast region or outside it (those of
    LayerNorm and GELU are not: torch does not promise it)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


class _WithBroadcast(nn.Module):
    """:func:`_mlp`'s kind of layers with a broadcast one: ``pos`` reads one fixed row that
    every sample shares (as a position table does), so its G is taken when its layer's
    statistics are (with ``overlap_comm``, in the reducer's gradient hook)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.pos, self.head = nn.Linear(5, 8), nn.Linear(4, 8), nn.Linear(8, 3)
        self.register_buffer("row", torch.randn(1, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.first(x) + self.pos(self.row)))


def _autocast_run(
    inside: bool, model_fn: Callable[[], nn.Module], **options: object
) -> tuple[KFACOptimizer, list[Tensor]]:
    """Three steps of ``model_fn``'s model with its forward in a bfloat16 autocast region,
    and the raw gradients of each step; ``inside``: ``backward()`` and ``step()`` are
    called inside the region too."""
    model = model_fn()
    opt = KFACOptimizer.for_model(model, lr=0.01, **options)  # type: ignore[arg-type]
    grads: list[Tensor] = []
    for step in range(3):
        x, y = _vectors(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x.float()), y)
            if inside:
                loss.backward()
                grads += [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
                opt.step()
        if not inside:
            loss.backward()
            grads += [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
            opt.step()
        opt.zero_grad()
    return opt, grads


@pytest.mark.parametrize(
    ("model_fn", "options"),
    [
        (_mlp, {}),
        (_mlp, {"method": "eigen"}),
        (_WithBroadcast, {"method": "eigen", "overlap_comm": "on"}),
    ],
    ids=["for_model", "eigen", "overlapped-broadcast"],
)
def test_a_backward_and_step_inside_the_autocast_region_are_those_outside_it(
    model_fn: Callable[[], nn.Module], options: dict[str, object]
) -> None:
    """Lightning's manual optimization (and many loops) run ``backward()`` and ``step()``
    inside the forward's autocast region: the factors and the update are computed in the
    dtypes they are outside it (autocast would make their products bfloat16), in the
    capture's hooks and in the overlapped reduction's."""
    (outside, grads_out), (inside, grads_in) = (
        _autocast_run(False, model_fn, **options),
        _autocast_run(True, model_fn, **options),
    )
    assert all(torch.equal(a, b) for a, b in zip(grads_out, grads_in, strict=True))
    _assert_same_factors(outside, inside)
    model_out, model_in = outside.preconditioner.model, inside.preconditioner.model
    assert max_difference(model_out, model_in) == 0.0


@pytest.mark.parametrize("loop", ["two backwards", "summed", "monte-carlo"])
def test_a_second_backward_through_one_forward_is_named_once(
    loop: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two losses of one forward backpropagated apart (``retain_graph=True``) are counted as
    two micro-batches, which the summed loss's factors are not: logged once, naming the
    fix. The summed loss's single backward, and the Monte-Carlo Fisher's own sampled
    backward through the training forward, are not named."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    options = {"fisher": "mc"} if loop == "monte-carlo" else {}
    opt = KFACOptimizer.for_model(model, lr=0.01, **options)
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    with caplog.at_level("WARNING", logger="dkfac"):
        for _ in range(2):
            opt.zero_grad()
            out = model(x)
            first, second = F.cross_entropy(out, y), out.square().mean()
            if loop == "two backwards":
                first.backward(retain_graph=True)
                second.backward()
            else:
                if loop == "monte-carlo":  # its sampled backward first, as it must be
                    opt.preconditioner.sample_fisher(out)
                (first + second).backward()
            opt.step()
    named = [r for r in caplog.records if "a second backward" in r.getMessage()]
    assert len(named) == (1 if loop == "two backwards" else 0), caplog.text


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Unflatten(1, (1, 4, 4)), nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
        nn.Linear(64, 3),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("model_fn", "features"), [(_mlp, 5), (_conv_net, 16)], ids=["mlp", "conv"]
)
def test_an_empty_batch_adds_no_rows(model_fn: Callable[[], nn.Module], features: int) -> None:
    """A batch of 0 samples (a sum-reduced loss: legal in torch, a step of nothing for
    AdamW) at a step that captures factors: the factors are those of the step before (a
    convolution's capture raised in ``backward()``), and the run goes on."""
    model = model_fn()
    pre = KFACPreconditioner(model, method="eigen", factor_decay=0.5, inverse_update_interval=1)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, features, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    for rows in (16, 0, 16):
        model.zero_grad()
        F.cross_entropy(model(x[:rows]), y[:rows], reduction="sum").backward()
        before = {name: [t.clone() for t in pair] for name, pair in pre.factors().items()}
        pre.step()
        if rows == 0:
            for name, pair in pre.factors().items():
                for got, want in zip(pair, before[name], strict=True):
                    assert torch.equal(got, want), name
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
