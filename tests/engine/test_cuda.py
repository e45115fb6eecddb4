"""CUDA equals CPU: every method, the moment options and a checkpoint, on a GPU.

The CUDA tests are skipped where torch sees no CUDA device (CI has none; the parity cases'
configurations are still built and stepped on the CPU there); run on a lent GPU with
``python3 -m pytest tests/engine/test_cuda.py``. In float64 the two devices run the same
formulas with different kernels (cuBLAS/cuSOLVER against MKL/LAPACK), so the weights after
a few steps agree to rounding; bases are compared through what they determine (an
eigenvector's sign is free, the sign-fixed QR of the power refresh is not). The batch (128)
is wider than every factor (at most 65), so each factor is of full rank with distinct
eigenvalues: its eigenbasis is unique up to signs, which Adam's elementwise moments do not
see. (With fewer samples than a factor is wide, the basis of its null space is arbitrary, each
library picks its own, and a step later the moments in that subspace differ.) Adam's
``m / (√v + ε)`` magnifies rounding in a coordinate whose gradient is near ``ε``: a rotation
of the bases by 1e-14 moved the weights after five steps by up to 3e-6 (relative) at ``ε =
1e-8``, 5e-11 at ``ε = 1e-3`` (1e-8 with the orthogonalised update, whose Newton-Schulz steps
magnify small singular values), so the eigen_adam cases run at ``ε = 1e-3`` (ekfac divides by
``v̂ + λ`` and has no ``ε``) and the weights are compared to 1e-7: a wrong basis, sign or carry
moves them by far more. The configurations are built on the CPU by
:func:`test_every_parity_case_is_a_valid_configuration`, which runs without a GPU, so that a
configuration error cannot hide behind the skip.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dkfac import KFACOptimizer, KFACPreconditioner
from dkfac.blocks.unitwise_stats import batch_moments, grouped_unit_fisher
from dkfac.engine.finite import finite_each
from dkfac.engine.step_math import sum_of_products
from dkfac.solvers.basis_refresh import power_refresh, range_eigh
from dkfac.solvers.eigen_moments import EigenMomentsSolver

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
STEPS = 5
BASE: dict[str, Any] = {
    "factor_decay": 0.9,
    "damping": 0.01,
    "inverse_update_interval": 2,
    "eigen_dtype": torch.float64,
}
MOMENTS: dict[str, Any] = {**BASE, "method": "eigen_adam", "kl_clip": None, "moment_eps": 1e-3}


def _model() -> nn.Module:
    """A convolution and a depthwise one (unit-wise: ``unitwise``, or ``unitwise_adam``
    under ``eigen_adam``), then three Linear layers (indices 3, 5 and 7)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1, groups=4)),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4 * 16, 40),
        nn.Tanh(),
        nn.Linear(40, 24),
        nn.Tanh(),
        nn.Linear(24, 3),
    ).double()


def _batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(128, 2, 4, 4, generator=gen, dtype=torch.float64)
    y = x.flatten(1)[:, :3].argmax(dim=1)  # learnable, so the loss can be followed
    return x.to(device), y.to(device)


def _train(
    device: torch.device,
    options: dict[str, Any],
    steps: int = STEPS,
    start: tuple[nn.Module, KFACOptimizer] | None = None,
    first: int = 0,
) -> tuple[nn.Module, KFACOptimizer]:
    if start is None:
        model = _model().to(device)
        pre = KFACPreconditioner(model, **options)
        opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), pre)
    else:
        model, opt = start
    for step in range(first, first + steps):
        x, y = _batch(step, device)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def _assert_same_weights(cpu: nn.Module, gpu: nn.Module, tol: float = 1e-7) -> None:
    for (name, a), b in zip(cpu.named_parameters(), gpu.parameters(), strict=True):
        torch.testing.assert_close(
            b.detach().cpu(), a.detach(), rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}"
        )


PARITY_CASES: list[dict[str, Any]] = [
    {**BASE, "method": "eigen"},
    {**BASE, "method": "cholesky"},
    {**BASE, "method": "smw"},
    {**BASE, "method": "ekfac", "kl_clip": None},  # ekfac has no eps: R / (v̂ + λ)
    MOMENTS,
    {**MOMENTS, "moment_nesterov": True, "basis_refresh": "power", "moment_carry": "rotate"},
    {
        **MOMENTS,
        "basis_refresh": "power",
        "power_rank": 8,
        "moment_carry": "reset",
        "orthogonal_layers": ("^3$", "^5$"),
        "orthogonal_steps": 3,
    },
]
PARITY_IDS = ["eigen", "cholesky", "smw", "ekfac", "eigen_adam", "power-rotate", "power-rank-ortho"]


@pytest.mark.parametrize("options", PARITY_CASES, ids=PARITY_IDS)
def test_every_parity_case_is_a_valid_configuration(options: dict[str, Any]) -> None:
    """On the CPU, without a GPU: the parity cases build (the skip must not hide a
    configuration error) and train one finite step."""
    model, opt = _train(torch.device("cpu"), options, steps=1)
    assert opt.skipped_steps == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


@needs_cuda
@pytest.mark.parametrize("options", PARITY_CASES, ids=PARITY_IDS)
def test_a_cuda_run_equals_the_cpu_run(options: dict[str, Any]) -> None:
    """Five steps (factors every step, the basis or inverse every two) in float64."""
    cpu, _ = _train(torch.device("cpu"), options)
    gpu, _ = _train(CUDA, options)
    _assert_same_weights(cpu, gpu)


@needs_cuda
@pytest.mark.parametrize("rank", [None, 24])
def test_power_refresh_on_cuda_equals_the_cpu_step(rank: int | None) -> None:
    """The sign-fixed QR is unique, so the basis itself (not only its span) must agree."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(400, 96, generator=gen, dtype=torch.float64)
    factor = rows.T @ rows / 400
    previous, _ = torch.linalg.qr(torch.randn(96, 96, generator=gen, dtype=torch.float64))
    values, basis = power_refresh(factor, previous, torch.float64, rank)
    gpu_values, gpu_basis = power_refresh(factor.to(CUDA), previous.to(CUDA), torch.float64, rank)
    kept = 96 if rank is None else rank
    torch.testing.assert_close(gpu_values.cpu(), values, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gpu_basis[:, :kept].cpu(), basis[:, :kept], rtol=0, atol=1e-10)
    # The completion is any orthonormal basis of the same complement.
    identity = torch.eye(96, dtype=torch.float64)
    torch.testing.assert_close((gpu_basis.T @ gpu_basis).cpu(), identity, rtol=0, atol=1e-12)


@needs_cuda
def test_range_eigh_on_cuda_gives_the_cpu_eigenpairs() -> None:
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(20, 120, generator=gen, dtype=torch.float64)
    factor = rows.T @ rows
    cpu = range_eigh(factor, torch.float64, 30)
    gpu = range_eigh(factor.to(CUDA), torch.float64, 30)
    assert cpu is not None and gpu is not None
    torch.testing.assert_close(gpu[0].cpu(), cpu[0], rtol=1e-10, atol=1e-10)
    rebuilt = (gpu[1] * gpu[0]) @ gpu[1].T
    torch.testing.assert_close(rebuilt.cpu(), factor, rtol=1e-10, atol=1e-9)


@needs_cuda
def test_a_cuda_checkpoint_resumes_on_the_cpu() -> None:
    """Three steps on the GPU, the state to the CPU, two more there = five on the GPU."""
    options = {**MOMENTS, "basis_refresh": "power", "moment_carry": "rotate"}
    gpu_model, gpu_opt = _train(CUDA, options, steps=3)
    saved = copy.deepcopy({"model": gpu_model.state_dict(), "opt": gpu_opt.state_dict()})
    _train(CUDA, options, steps=2, start=(gpu_model, gpu_opt), first=3)

    cpu_saved = torch.utils._pytree.tree_map(
        lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, saved
    )
    model = _model()
    model.load_state_dict(cpu_saved["model"])
    opt = KFACOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), KFACPreconditioner(model, **options)
    )
    opt.load_state_dict(cpu_saved["opt"])
    _train(torch.device("cpu"), options, steps=2, start=(model, opt), first=3)
    _assert_same_weights(model, gpu_model)


@needs_cuda
def test_the_autoencoder_recipe_under_bf16_autocast_follows_the_cpu_loss() -> None:
    """The recipe's lowered precisions (bf16 rotations, capture under bf16 autocast) in
    float32: not bitwise across devices, but the loss of every step within 0.03 of the CPU's
    (on the CPU the same run and its float32 twin differ by at most 0.01) and falling."""
    options = {
        "method": "eigen_adam",
        "kl_clip": None,
        "moment_nesterov": True,
        "moment_carry": "reset",
        "basis_refresh": "power",
        "power_rank": 16,
        "inverse_update_interval": 2,
        "rotation_dtype": torch.bfloat16,
        "gradient_rotation_dtype": torch.bfloat16,
        "orthogonal_layers": ("^3$", "^5$"),
        "orthogonal_steps": 3,
    }
    losses = []
    for device in (torch.device("cpu"), CUDA):
        model = _model().float().to(device)
        pre = KFACPreconditioner(model, **options)
        opt = KFACOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), pre)
        run = []
        for step in range(10):
            x, y = _batch(step, device)
            opt.zero_grad()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x.float()), y)
            loss.backward()
            opt.step()
            run.append(loss.item())
        assert opt.skipped_steps == 0
        losses.append(torch.tensor(run))
    cpu, gpu = losses
    assert (gpu - cpu).abs().max() < 0.03, (cpu, gpu)
    assert gpu[-1] < gpu[0] - 0.15, gpu


@needs_cuda
def test_the_launch_bound_forms_on_cuda_equal_the_cpu_ones() -> None:
    """What a CUDA device runs instead of the CPU's forms (a GPU step is launches):
    BatchNorm's batch moments by ``torch.batch_norm_stats``, the finiteness checks as
    1-norms and the KL-clip's sum as multi-tensor calls."""
    gen = torch.Generator().manual_seed(5)
    for shape in ((32, 6), (16, 6, 5), (8, 6, 7, 7)):
        x = torch.randn(shape, generator=gen) * 3.0 + 2.0
        want = batch_moments(x.double(), 1e-5)
        got = batch_moments(x.to(CUDA), 1e-5)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == torch.float32 and g.device.type == "cuda"
            torch.testing.assert_close(g.cpu().double(), w, rtol=1e-5, atol=1e-6)
    tensors = [torch.randn(5, 3, generator=gen) for _ in range(4)] + [torch.ones(3).half()]
    tensors[1][2, 1] = float("nan")
    tensors[3][0, 0] = float("-inf")
    on_gpu = [t.to(CUDA) for t in tensors]
    flags = finite_each(on_gpu, CUDA)
    assert flags.device.type == "cuda"
    assert flags.tolist() == finite_each(tensors, torch.device("cpu")).tolist()
    assert flags.tolist() == [True, False, True, False, True]
    lefts = [torch.randn(4, 3, generator=gen) for _ in range(3)]
    rights = [torch.randn(4, 3, generator=gen) for _ in range(3)]
    want_sum = sum_of_products([t.double() for t in lefts], rights, lefts[0].double())
    got_sum = sum_of_products(
        [t.to(CUDA) for t in lefts], [t.to(CUDA) for t in rights], lefts[0].to(CUDA)
    )
    assert got_sum.device.type == "cuda"
    assert float(got_sum) == pytest.approx(float(want_sum), rel=1e-5, abs=1e-5)


@needs_cuda
def test_grouped_batchnorm_statistics_on_cuda_equal_the_cpu_ones() -> None:
    """The BatchNorm group's sums (what a CUDA step computes for layers of one shape)."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 8, 6, 5, 5, generator=gen) * 2.0 + 1.0
    delta = torch.randn(3, 8, 6, 5, 5, generator=gen)
    want = grouped_unit_fisher(x.double(), delta.double(), 1e-5)
    got = grouped_unit_fisher(x.to(CUDA), delta.to(CUDA), 1e-5)
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-4)


def _steady_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 16, 64),
        nn.LayerNorm(64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 3),
    ).to(device)


def _train_without_sync(
    opt: KFACOptimizer, model: nn.Module, steps: int, free: tuple[int, ...]
) -> None:
    """``steps`` whole iterations (the capture hooks run in the forward and the backward)
    under ``torch.cuda.set_sync_debug_mode("error")``, but the steps in ``free``; the guard
    on the device (from the first step), no step skipped, the weights finite."""
    batches = [_batch(step, CUDA) for step in range(steps)]  # made before the checks
    for step, (x, y) in enumerate(batches):
        torch.cuda.set_sync_debug_mode(0 if step in free else "error")
        try:
            opt.zero_grad()
            F.cross_entropy(model(x.float()), y).backward()
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert opt.preconditioner.flags_on_device
    assert opt.skipped_steps == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


@needs_cuda
@pytest.mark.parametrize("method", ["eigen", "eigen_adam"])
def test_a_steady_cuda_step_makes_no_host_synchronisation(method: str) -> None:
    """Plain and factor steps under ``torch.cuda.set_sync_debug_mode("error")``: the guard's
    flags stay on the device and the fused inner SGD skips on its ``found_inf``. The first
    step (no running factors to hold yet) and the refreshes (an ``"eigh"`` refresh: see
    the next test) are left out, as ``tests/engine/test_device_checks.py`` counts on the
    CPU."""
    model = _steady_model(CUDA)
    opt = KFACOptimizer.for_model(
        model, method=method, factor_update_interval=2, inverse_update_interval=4
    )
    _train_without_sync(opt, model, steps=8, free=(0, 4))


@needs_cuda
def test_a_model_moved_to_cuda_after_the_build_makes_no_host_synchronisation() -> None:
    """Built on the CPU, then moved (as accelerate's ``prepare`` and the Trainer move it):
    from the first step the guard's flags stay on the device and ``for_model``'s SGD is
    fused, so the later steps make no host synchronisation either."""
    model = _steady_model(torch.device("cpu"))
    opt = KFACOptimizer.for_model(model, factor_update_interval=2, inverse_update_interval=4)
    assert not opt.preconditioner.flags_on_device
    model.to(CUDA)
    _train_without_sync(opt, model, steps=8, free=(0, 4))
    assert all(group["fused"] for group in opt.param_groups)


@needs_cuda
def test_a_power_refresh_on_cuda_makes_no_host_synchronisation() -> None:
    """Every step after the first under ``torch.cuda.set_sync_debug_mode("error")``, refresh
    steps included: ``eigen_adam`` with ``basis_refresh="power"`` (a product and a QR a
    side), its null spaces in fixed shapes and its new states checked on the device
    (:mod:`dkfac.engine.refresh_checks`), as ``tests/engine/test_device_checks.py`` counts
    on the CPU. An ``"eigh"`` refresh is left out: ``torch.linalg.eigh`` itself checks its
    convergence on the host."""
    model = _steady_model(CUDA)
    opt = KFACOptimizer.for_model(
        model,
        method="eigen_adam",
        basis_refresh="power",
        factor_update_interval=2,
        inverse_update_interval=4,
    )
    _train_without_sync(opt, model, steps=10, free=(0,))


@needs_cuda
def test_the_device_guard_on_cuda_skips_as_the_cpu_guard_does() -> None:
    """A NaN in one layer's gradient, then in the input: the CUDA run (flags on the device,
    warnings a step late) ends where the CPU run (flags read) ends, in float64."""

    def run(device: torch.device) -> tuple[nn.Module, KFACOptimizer]:
        model = _steady_model(device).double()
        opt = KFACOptimizer.for_model(model, eigen_dtype=torch.float64, moment_eps=1e-3)
        assert opt.preconditioner.flags_on_device == (device.type == "cuda")
        for step in range(6):
            x, y = _batch(step, device)
            if step == 4:
                x[0, 0, 0, 0] = float("nan")
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if step == 2:
                model[7].weight.grad[0, 0] = float("nan")
            opt.step()
        return model, opt

    cpu, cpu_opt = run(torch.device("cpu"))
    gpu, gpu_opt = run(CUDA)
    assert cpu_opt.skipped_steps == gpu_opt.skipped_steps == 2
    _assert_same_weights(cpu, gpu)


@needs_cuda
@pytest.mark.parametrize(
    ("option", "compiled"), [("compile_moments", "_moment_step"), ("compile_step", "_update")]
)
def test_compiled_steps_on_cuda_equal_eager_ones(option: str, compiled: str) -> None:
    """``compile_moments="inductor"`` (generated Triton kernels for the flat moment pass) and
    ``compile_step="inductor"`` (each group's rotations, moments and polar factor) against
    ``"off"`` on the GPU, float64 at ``ε = 1e-3`` (module notes): the weights after six
    steps to 1e-7, every solver still compiled, and the compiled run's steady steps make no
    host synchronisation (the first two steps compile, the second after the overhead
    budget has chosen its Newton-Schulz steps, and the refresh at step 4 checks its states
    and may compile again)."""
    models = [_steady_model(CUDA).double() for _ in range(2)]
    opts = [
        KFACOptimizer.for_model(
            model,
            moment_eps=1e-3,
            factor_update_interval=2,
            inverse_update_interval=4,
            **{option: choice},
        )
        for model, choice in zip(models, ("inductor", "off"), strict=True)
    ]
    for step in range(6):
        x, y = _batch(step, CUDA)
        for i, (model, opt) in enumerate(zip(models, opts, strict=True)):
            steady = i == 0 and step in (2, 3, 5)
            torch.cuda.set_sync_debug_mode("error" if steady else 0)
            try:
                opt.zero_grad()
                F.cross_entropy(model(x.double()), y).backward()
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    layers = opts[0].preconditioner.layers.values()
    solvers = [lay.solver for lay in layers if isinstance(lay.solver, EigenMomentsSolver)]
    assert solvers and all(getattr(s, compiled).active for s in solvers)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7)
