"""The options of the eigenbasis-moment solvers (``"eigen_adam"``, ``"ekfac"``) and the
checks of their combinations; the formulas they set are in
:mod:`dkfac.solvers.eigen_moments`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from dkfac.solvers.compiled import check_backend
from dkfac.solvers.null_space import ROUNDING_FLOOR
from dkfac.solvers.polar import NS_STEPS
from dkfac.solvers.precision import LowPrecision

__all__ = [
    "BASIS_REFRESHES",
    "MOMENT_CARRIES",
    "BasisRefresh",
    "MomentCarry",
    "MomentOptions",
    "check_moment_combinations",
]

BasisRefresh = Literal["eigh", "power"]
MomentCarry = Literal["reset", "keep_v", "rotate"]
BASIS_REFRESHES: tuple[str, ...] = get_args(BasisRefresh)
MOMENT_CARRIES: tuple[str, ...] = get_args(MomentCarry)


@dataclass(frozen=True, kw_only=True)
class MomentOptions:
    """Hyperparameters of the eigenbasis-moment solvers (see the module notes).

    Attributes:
        beta1: First-moment decay β₁ in [0, 1) (``"eigen_adam"`` only).
        beta2: Second-moment decay β₂ in [0, 1).
        eps: ``ε`` > 0 added to ``√v̂`` (``"eigen_adam"``; ``"ekfac"`` adds the damping).
        bias_correction: Divide the moments by ``1−βᵗ``.
        nesterov: Nesterov's look-ahead first moment (``"eigen_adam"`` only).
        basis_refresh: ``"eigh"`` or ``"power"``.
        carry: ``"reset"``, ``"keep_v"`` or ``"rotate"``.
        max_dim: A factor of a larger dimension keeps the identity basis (one-sided);
            ``None``: every factor is rotated.
        rotation_dtype: Precision of the rotation of the update out of the basis (module
            notes); ``None``: the gradient's (the polar factor's with ``orthogonal_rms``).
        orthogonal_rms: The update ``V`` is replaced by its orthogonal polar factor scaled
            to this RMS entry (:func:`dkfac.solvers.polar.orthogonal_update`; module notes);
            ``None``: ``V`` itself.
        orthogonal_rms_power: ``p`` in [0, 1]: the polar factor's RMS entry is
            ``orthogonal_rms^(1−p) · r^p``, ``r`` the RMS entry of the ``V`` it replaces
            (each matrix's, at each step; module notes); 0 (default): ``orthogonal_rms``.
            Needs ``orthogonal_rms``, and no ``orthogonal_split``.
        orthogonal_steps: Newton–Schulz steps of that polar factor (>= 1; default 5).
        orthogonal_split: The share ``S`` in [0, 1] of the scaling ``D⁻¹`` (Adam's ``1 /
            (√v̂ + ε)``, EKFAC's ``1 / (v̂ + λ)``) applied after the polar factor instead
            of before it: ``D^-S ⊙ polar(D^(S-1) ⊙ m̂)`` rescaled to RMS
            ``orthogonal_rms`` (module notes); 0 (default): the polar factor of the scaled
            update. Needs ``orthogonal_rms``.
        gradient_rotation_dtype: Precision of the dense products of the rotation of the
            gradient into the basis (module notes; not float16); ``None``: the gradient's.
            Needs ``carry="reset"``.
        power_rank: A ``"power"`` refresh follows only the leading ``power_rank``
            eigenvectors of a wider factor; the rest of its basis becomes an orthonormal
            completion (:func:`~dkfac.solvers.basis_refresh.power_refresh`); ``None``: every
            column follows. Needs
            ``carry`` ``"reset"`` or ``"rotate"`` (a kept ``v`` would belong to other
            directions).
        block_size: A factor wider than this gets a block-diagonal basis: its dimension
            cut into consecutive blocks of ``block_size`` (the last one shorter), each
            with the basis of the factor's diagonal block (module notes); ``None``: every
            basis is dense.
        rounding_floor: ``φ / ‖√v̂‖_F``, the floor added to Adam's ``ε`` at the rounding
            level of the rotated gradient (>= 0; ``"eigen_adam"`` only; module notes and
            :mod:`~dkfac.solvers.null_space`); 0 for Adam without a basis (the leftover
            update), where nothing is rotated.
        compile_backend: The moment update and scaling run through ``torch.compile`` with
            this backend (:mod:`dkfac.solvers.compiled`: ``"inductor"`` or
            ``"aot_eager"``, eager after a failure); ``None``: eagerly.
        step_compile_backend: A group's whole update (the rotations into and out of the
            basis, the moments and the polar factor: everything
            :meth:`~dkfac.solvers.eigen_moments.EigenMomentsSolver.apply_with_moments`
            does after choosing its bases' precision) runs through ``torch.compile`` with
            this backend, the moment step traced into it (``compile_backend`` then applies
            only to the flat pass over several groups); ``None``: as ``compile_backend``
            says.
    """

    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    bias_correction: bool = True
    nesterov: bool = False
    basis_refresh: BasisRefresh = "eigh"
    carry: MomentCarry = "keep_v"
    max_dim: int | None = None
    rotation_dtype: torch.dtype | None = None
    orthogonal_rms: float | None = None
    orthogonal_rms_power: float = 0.0
    orthogonal_steps: int = NS_STEPS
    orthogonal_split: float = 0.0
    gradient_rotation_dtype: torch.dtype | None = None
    power_rank: int | None = None
    block_size: int | None = None
    rounding_floor: float = ROUNDING_FLOOR
    compile_backend: str | None = None
    step_compile_backend: str | None = None

    def __post_init__(self) -> None:
        check_backend(self.compile_backend)
        check_backend(self.step_compile_backend, "step_compile_backend")
        for name in ("rotation_dtype", "gradient_rotation_dtype"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise ValueError(f"{name} must be None or a floating torch.dtype, got {value!r}")
        if self.gradient_rotation_dtype == torch.float16:
            raise ValueError(
                "gradient_rotation_dtype float16 would flush gradients below 6e-8 to zero; "
                "use torch.bfloat16, torch.float32 or torch.float64"
            )
        for name, value, optional in (
            ("orthogonal_steps", self.orthogonal_steps, False),
            ("max_dim", self.max_dim, True),
            ("power_rank", self.power_rank, True),
            ("block_size", self.block_size, True),
        ):
            if optional and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                allowed = "an integer >= 1" + (" or None" if optional else "")
                raise ValueError(f"{name} must be {allowed}, got {value!r}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)):
            raise TypeError(f"eps must be a number, got {type(self.eps).__name__}")
        if not 0.0 < self.eps < float("inf"):
            raise ValueError(f"eps must be a finite number > 0, got {self.eps!r}")
        floor = self.rounding_floor
        if isinstance(floor, bool) or not isinstance(floor, (int, float)):
            raise TypeError(f"rounding_floor must be a number, got {type(floor).__name__}")
        if not 0.0 <= floor < float("inf"):
            raise ValueError(f"rounding_floor must be a finite number >= 0, got {floor!r}")
        for name in ("bias_correction", "nesterov"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.basis_refresh not in BASIS_REFRESHES:
            raise ValueError(
                f"basis_refresh must be one of {BASIS_REFRESHES}, got {self.basis_refresh!r}"
            )
        if self.carry not in MOMENT_CARRIES:
            raise ValueError(f"carry must be one of {MOMENT_CARRIES}, got {self.carry!r}")
        rms = self.orthogonal_rms
        if rms is not None and (isinstance(rms, bool) or not isinstance(rms, (int, float))):
            raise TypeError(f"orthogonal_rms must be a number or None, got {type(rms).__name__}")
        if rms is not None and not 0.0 < rms < float("inf"):
            raise ValueError(f"orthogonal_rms must be a finite number > 0 or None, got {rms!r}")
        for name, what in (
            ("orthogonal_split", "splits the scaling around the polar factor"),
            ("orthogonal_rms_power", "lets the polar factor's length follow the update's"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
            if value and rms is None:
                raise ValueError(
                    f"{name} {value} {what}, which only an orthogonalised update has: set "
                    "orthogonal_rms too, or drop it"
                )
        split = self.orthogonal_split
        check_moment_combinations(
            basis_refresh=self.basis_refresh,
            carry=self.carry,
            gradient_rotation_dtype=self.gradient_rotation_dtype,
            power_rank=self.power_rank,
            orthogonal_rms_power=self.orthogonal_rms_power,
            orthogonal_split=split,
        )


def check_moment_combinations(
    *,
    basis_refresh: str,
    carry: str,
    gradient_rotation_dtype: LowPrecision,
    power_rank: int | None,
    carry_name: str = "carry",
    orthogonal_rms_power: float = 0.0,
    orthogonal_split: float = 0.0,
) -> None:
    """Raises ValueError for the option pairs the solvers cannot honour (shared by
    :class:`MomentOptions` and the engine's config, which names the carry ``carry_name``).

    A lowered gradient rotation (``"auto"`` included: it may resolve to bf16) needs the
    ``"reset"`` carry (a carried second moment would meet gradients rotated with another
    rounding); ``power_rank`` needs the ``"power"`` refresh, and not the ``"keep_v"`` carry
    (the completion changes at every refresh, so a kept second moment would scale other
    directions); ``orthogonal_rms_power`` takes the plain polar factor, not a split one
    (which is rescaled to a fixed RMS).
    """
    if orthogonal_split and orthogonal_rms_power:
        raise ValueError(
            f"orthogonal_split {orthogonal_split} rescales the split polar factor to a fixed "
            f"RMS, which orthogonal_rms_power {orthogonal_rms_power} would let follow the "
            "update's: drop one of them"
        )
    if gradient_rotation_dtype is not None and carry != "reset":
        raise ValueError(
            f"gradient_rotation_dtype needs {carry_name} 'reset' (a carried second moment "
            f"meets gradients rotated with another rounding), got {carry_name} {carry!r}"
        )
    if power_rank is not None and basis_refresh != "power":
        raise ValueError(
            "power_rank sets the columns a 'power' refresh follows; it needs "
            f"basis_refresh 'power', got {basis_refresh!r}"
        )
    if power_rank is not None and carry == "keep_v":
        raise ValueError(
            "power_rank rebuilds the rest of the basis at each refresh, where a kept second "
            f"moment would scale other directions; use {carry_name} 'reset' or 'rotate'"
        )
