"""The solver group: :class:`SolverConfig`, how the damped inverse is applied and the step it
makes, with the rules on which method reads which of its moment options.

The methods a field accepts come from :data:`dkfac.solvers.METHODS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Literal, get_args

import torch

from dkfac.config.checks import (
    BLOCK_WIDTHS,
    check_bool,
    check_choice,
    check_dtype,
    check_input_maps,
    check_int,
    check_patterns,
    check_range,
    python_numbers,
    shown,
)
from dkfac.config.schedules import Schedule, check_schedules
from dkfac.solvers import (
    BASIS_REFRESHES,
    METHODS,
    MOMENT_CARRIES,
    NS_STEPS,
    SOLVERS,
    BasisRefresh,
    EigenMomentsSolver,
    MethodName,
    MomentCarry,
    MomentOptions,
    adam_scaled,
    check_moment_combinations,
    method_names,
)

__all__ = [
    "COMPILE_MOMENTS",
    "COMPILE_STEPS",
    "LEFTOVER_UPDATES",
    "METHODS",
    "CompileMoments",
    "CompileStep",
    "LeftoverUpdate",
    "Method",
    "SolverConfig",
    "leftover_adam",
    "unread_moment_fields",
]

Method = MethodName
MOMENT_METHODS = tuple(
    sorted(n for n, cls in SOLVERS.items() if n in METHODS and issubclass(cls, EigenMomentsSolver))
)
"""The built-in methods with an eigenbasis of moments (``flattened_inputs`` needs one)."""
UNREAD_WITHOUT_MOMENTS = (
    "moment_beta1",
    "moment_beta2",
    "moment_eps",
    "moment_bias_correction",
    "moment_nesterov",
    "basis_refresh",
    "moment_carry",
    "compile_moments",
    "compile_step",
)
"""The :class:`SolverConfig` fields that only a method with a basis of moments reads."""
ORTHOGONAL_RMS = 1.5
"""Default RMS entry of an orthogonalised update per unit of learning rate (the language-model
recipe's)."""
ORTHOGONAL_STEPS_MAX = 100
"""The most Newton–Schulz steps of an orthogonalised update: from the fifth step on the
quintic iteration keeps the singular values in a band about one, without converging further
(:mod:`dkfac.solvers.polar`), so more steps only cost time (``2**62`` of them never end)."""
LeftoverUpdate = Literal["auto", "gradient", "adam"]
LEFTOVER_UPDATES: tuple[str, ...] = get_args(LeftoverUpdate)
CompileMoments = Literal["auto", "off", "inductor", "aot_eager"]
COMPILE_MOMENTS: tuple[str, ...] = get_args(CompileMoments)
CompileStep = Literal["off", "inductor", "aot_eager"]
COMPILE_STEPS: tuple[str, ...] = get_args(CompileStep)


@dataclass(frozen=True, kw_only=True)
class SolverConfig:
    """How the damped inverse is applied, and the step it makes.

    Attributes:
        method: ``"eigen"`` (exact Tikhonov damping of A⊗G through eigendecompositions,
            SC20), ``"cholesky"`` (factored damping with the π-correction), ``"smw"``
            (Sherman–Morrison–Woodbury low-rank inverse, SKFAC), ``"ekfac"`` (a diagonal
            rescaling in the Kronecker eigenbasis, EKFAC), ``"eigen_adam"`` (Adam's moments
            in that eigenbasis: the whole update, for an inner SGD without momentum and
            without the KL-clip; ``KFACOptimizer.for_model``'s) or ``"auto"`` (chosen per
            layer from the shapes); the table is :data:`dkfac.solvers.METHODS`.
        damping: Tikhonov damping λ > 0, constant or a schedule of the step. The default,
            0.03, is relative to factors on the per-sample Fisher scale; with 1e-3 the
            default ``dkfac train --optimizer kfac`` runs on digits diverged. A grouped
            convolution's unit-wise solve takes it too.
        bn_damping: Damping of the unit-wise BatchNorm solve (constant or schedule);
            ``None`` (default) uses ``damping`` itself.
        kl_clip: KL-clip constant κ > 0, or ``None`` to disable the clip.
        lr: Learning rate used by the KL-clip (constant or schedule); ``KFACOptimizer`` feeds
            the inner optimizer's current value instead.
        eigen_dtype: Precision of the eigendecompositions / inversions (SMW's too):
            ``torch.float32``, ``torch.float64`` or ``None`` (default): the factors' dtype,
            at least float32 (a float64 model gets float64 decompositions).
        moment_beta1: β₁ in [0, 1) of the first moment (``"eigen_adam"``). This and the
            next six fields are read only by the methods named with them: moved from its
            default with another built-in method, each is an error (not silently unused;
            :func:`unread_moment_fields`).
        moment_beta2: β₂ in [0, 1) of the second moment (``"ekfac"``, ``"eigen_adam"``).
        moment_eps: ε > 0 added to ``√v̂`` (``"eigen_adam"``).
        moment_bias_correction: Divide the moments by ``1 − βᵗ`` (``"ekfac"``,
            ``"eigen_adam"``).
        moment_nesterov: Nesterov's look-ahead first moment (``"eigen_adam"``).
        basis_refresh: How the eigenbasis of moments is refreshed at the inverse interval
            (``"ekfac"``, ``"eigen_adam"``): ``"eigh"``
            (a full eigendecomposition) or ``"power"`` (one power-iteration step and a QR
            from the previous basis; the first refresh is a full eigendecomposition).
        moment_carry: What the moments become when the basis is refreshed (``"ekfac"``,
            ``"eigen_adam"``): ``"reset"``,
            ``"keep_v"`` (the first moment rotated exactly, the second kept, as SOAP does)
            or ``"rotate"`` (the second moment rotated approximately too). Formulas:
            :mod:`dkfac.solvers.eigen_moments`.
        basis_max_dim: ``"ekfac"``/``"eigen_adam"``: a factor of a larger dimension keeps the
            identity as its basis and is never decomposed, so a very wide layer is
            preconditioned on its other side only (one-sided, like SOAP's
            ``max_precond_dim``); only that factor's diagonal is captured (nothing reads
            the rest). ``None`` (default): every factor is rotated.
        rotation_dtype: ``"ekfac"``/``"eigen_adam"``: precision of the rotation of the update
            out of the eigenbasis (half of their per-step cost): ``None`` (default) the
            gradient's, or on an ``orthogonal_layers`` layer a low one (its polar factor is
            rotated out: bfloat16 where the device multiplies bf16 natively, on a CPU only
            for products of ``128³`` multiply-adds and more; float32 elsewhere, float64 for
            float64: :func:`dkfac.solvers.precision.low_precision`); ``torch.bfloat16`` runs it
            2-3x faster on CPUs with bf16 matrix instructions and on GPUs, for an error of
            about 1% of the update, and many times slower where bf16 is emulated (an AVX2
            CPU); ``"auto"``: bfloat16 where the layer's device multiplies it natively, the
            default elsewhere (:mod:`dkfac.solvers.precision`). The rotation into the
            basis, the moments and the basis keep their own precision
            (:mod:`dkfac.solvers.eigen_moments`).
        gradient_rotation_dtype: ``"ekfac"``/``"eigen_adam"``: precision of the rotation of
            the gradient into the eigenbasis (the other half of their per-step cost):
            ``None`` (default) the gradient's; ``torch.bfloat16`` or ``"auto"`` as above
            (``torch.float32`` and ``torch.float64`` too; not float16, which flushes small
            gradients). Needs ``moment_carry="reset"`` (a carried second moment would meet
            gradients rotated with another rounding; the reason is in
            :mod:`dkfac.solvers.eigen_moments`).
            The entries of the rotated gradient below the rounding then move with the sign
            the rounding gives them, so distributed runs match serial ones only to that
            rounding (the ranks agree to the bit).
        flattened_inputs: ``"ekfac"``/``"eigen_adam"``: linear layers that read a flattened
            ``channels × positions`` map (a convolution's output flattened channel-major,
            ``torch.flatten``'s order), by qualified name: ``{"classifier.0": (64, 16)}``,
            or strings ``"classifier.0=64x16"`` (the command line's spelling). Their input
            factor gets a Kronecker-structured basis ``Q_C ⊗ Q_P`` from its two partial
            traces (:mod:`dkfac.solvers.kron_basis`): a refresh of a 1025-wide factor in
            milliseconds instead of a 1025³ product and QR, for the same steps on the
            digits CNN. A name that is not a registered linear
            layer with ``channels · positions`` inputs is an error at registration, as is
            the map the graph shows with its sides swapped (another map than the graph's
            is used, with a warning).
            ``"graph"`` finds them in the model's graph, with no names
            (:func:`dkfac.engine.roles.flattened_conv_inputs`), among the layers K-FAC
            preconditions (one it does not, skipped or declined, needs no map).
        orthogonal_layers: ``"ekfac"``/``"eigen_adam"``: regular expressions; a
            preconditioned layer whose qualified name or class name contains a match of one
            (``re.search``, as ``skip_layers``; ``"role:hidden"`` picks the hidden matrices,
            :mod:`dkfac.engine.roles`) takes the orthogonal polar factor of its
            update, scaled to ``orthogonal_rms`` (Muon's Newton–Schulz step applied to the
            preconditioned update: :mod:`dkfac.solvers.eigen_moments`). Meant for a
            transformer's hidden layers, e.g. ``("^blocks\\.",)``, leaving the embeddings
            and the head to the plain method as Muon does. A
            pattern that matches no preconditioned layer is an error at registration.
        orthogonal_rms: RMS entry (> 0) of an orthogonalised update per unit of learning
            rate (default 1.5, the language-model recipe's: at ``lr=0.003`` a 128 × 128
            layer then steps about as far as under Muon at its lr 0.05; an AdamW update's
            RMS entry is about 0.2–0.4 of its lr).
            A value other than the default without ``orthogonal_layers`` is an error.
        orthogonal_rms_power: ``p`` in [0, 1]: the orthogonalised update's RMS entry per
            unit of lr becomes ``orthogonal_rms^(1−p) · r^p``, ``r`` the RMS entry of the
            update the polar factor replaces (Adam's normalised step in the eigenbasis, each
            matrix's at each step: :func:`~dkfac.solvers.polar.orthogonal_update`); ``r`` is
            about 1 while the moments see more signal than noise and shrinks with the
            noise. 0 (default): the fixed ``orthogonal_rms``; 1: Adam's own length. Not
            with ``orthogonal_split``; a value other than 0 without ``orthogonal_layers`` is
            an error.
        orthogonal_input_rms: Divide each orthogonalised update by the RMS entry of its
            layer's input row (the bias's 1 counted), from this step's forwards and ranks (one
            all-reduce of two numbers a layer): a layer fed small inputs takes a longer step, so
            that ``ΔW·a`` has about the same size in every layer and at every step
            (:mod:`dkfac.engine.input_rms`). False (default): the same length for every
            layer. True without ``orthogonal_layers`` is an error.
        orthogonal_steps: Newton–Schulz steps (1 to 100) of that polar factor (default 5,
            Muon's); three cost 3/5 of the flops and leave the smallest singular values
            short of one (:mod:`dkfac.solvers.polar`), enough after the eigenbasis
            preconditioning. A value other than the default without
            ``orthogonal_layers`` is an error.
        orthogonal_split: The share ``S`` in [0, 1] of the update's scaling (Adam's ``1 /
            (√v̂ + ε)`` under ``"eigen_adam"``) applied after the polar factor instead of
            before it: ``D^-S ⊙ polar(D^(S-1) ⊙ m̂)``, rescaled to RMS ``orthogonal_rms``
            (:mod:`dkfac.solvers.eigen_moments`); 0 (default): the polar factor of the
            scaled update. 0.5 is the language-model recipe's: 0.05 to 0.09 nats lower
            than 0 at 50, 75 and 125 steps, level at 100, for a few elementwise passes. A
            value other than 0 without
            ``orthogonal_layers`` is an error.
        power_rank: ``basis_refresh="power"`` only: a refresh follows the leading
            ``power_rank`` eigenvectors of a wider factor and completes them with an
            orthonormal basis of the rest (unrelated to the previous one), instead of
            following every column: about a third of the refresh of a 1000-wide factor at
            256, for the same steps on the digits autoencoder.
            Needs ``moment_carry`` ``"reset"`` or ``"rotate"`` (the rest of the basis
            changes at every refresh, so a kept second moment would scale other
            directions). ``None`` (default): every column follows.
        basis_block_size: ``"ekfac"``/``"eigen_adam"``: a factor wider than this (and not
            wider than ``basis_max_dim``) gets a block-diagonal basis, its dimension cut
            into consecutive blocks of this width (the last one shorter), and only those
            diagonal blocks of the factor are captured: for a side ``k`` blocks wide,
            ``1/k`` of the flops of its capture and rotations and ``1/k²`` of its refresh's
            decompositions, for the correlations between blocks
            (:mod:`dkfac.solvers.eigen_moments`; a convolution's precomputed sum is formed
            whole, then masked). Meant for sides whose units have no order, such as a
            transformer MLP's 4·width hidden units; it applies to
            every layer. Not applied to the structured input side of ``flattened_inputs``.
            With ``basis_max_dim`` it must be smaller (else no side would get blocks).
            ``"widths"``: read off the model when the preconditioner is built
            (:func:`dkfac.engine.roles.basis_block_from_widths`): the narrowest output
            width of a hidden layer that is at least 128 wide, where some side is more than
            twice that, else every basis whole (the recipes' 250 on a 64-1000-500-250-30
            autoencoder, 128 on a width-128 transformer with a 512-wide MLP).
            ``None`` (default): every basis is dense.
        leftover_update: What the parameters no block preconditions (LayerNorms, raw
            ``nn.Parameter``; ``describe()`` lists them) hand the inner optimizer:
            ``"gradient"`` their plain gradient, ``"adam"`` Adam's direction on it (the
            eigen_adam solver with the identity as basis and this config's ``moment_*``
            options, so every parameter steps as Adam would at the inner optimizer's lr;
            :mod:`dkfac.engine.leftover`), allowed with a method whose update has Adam's
            scale (``Solver.adam_scaled``: ``"eigen_adam"``). ``"auto"`` (default):
            ``"adam"`` under such a method (a LayerNorm's plain gradient at its lr hardly
            moves it), else ``"gradient"``.
        compile_moments: ``"ekfac"``/``"eigen_adam"``: run each step's moment update and
            scaling through ``torch.compile`` (:mod:`dkfac.solvers.compiled`; eager after a
            failure, logged): ``"inductor"`` (fused generated kernels; on a CPU it needs a C
            compiler), ``"aot_eager"`` (the capture only, for checks), ``"off"``, or
            ``"auto"`` (default): ``"inductor"`` on a launch-bound device (CUDA) where
            Triton is installed, ``"off"`` elsewhere (a CPU's elementwise passes are not
            launches, and compiling costs seconds).
        compile_step: ``"ekfac"``/``"eigen_adam"``: run each group's whole update of a step
            (a group: the layers of one shape and options; the rotations into and out of
            its basis, the moments and the polar factor) through ``torch.compile``, with
            the moment step inside it (``compile_moments`` then applies only to the flat
            pass over several groups on a CUDA device): ``"inductor"``, ``"aot_eager"``
            (as for ``compile_moments``) or ``"off"`` (default). Each group compiles a graph
            of its own at its first step (seconds), and eager runs after a failure, logged.
    """

    method: Method = "eigen"
    damping: Schedule = 0.03
    bn_damping: Schedule | None = None
    kl_clip: Schedule | None = 1e-3
    lr: Schedule = 0.1
    eigen_dtype: torch.dtype | None = None
    moment_beta1: float = 0.9
    moment_beta2: float = 0.95
    moment_eps: float = 1e-8
    moment_bias_correction: bool = True
    moment_nesterov: bool = False
    basis_refresh: BasisRefresh = "eigh"
    moment_carry: MomentCarry = "keep_v"
    basis_max_dim: int | None = None
    rotation_dtype: torch.dtype | Literal["auto"] | None = None
    flattened_inputs: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    orthogonal_layers: tuple[str, ...] = field(default_factory=tuple)
    orthogonal_rms: float = ORTHOGONAL_RMS
    orthogonal_rms_power: float = 0.0
    orthogonal_input_rms: bool = False
    orthogonal_steps: int = NS_STEPS
    orthogonal_split: float = 0.0
    gradient_rotation_dtype: torch.dtype | Literal["auto"] | None = None
    power_rank: int | None = None
    basis_block_size: int | Literal["widths"] | None = None
    leftover_update: LeftoverUpdate = "auto"
    compile_moments: CompileMoments = "auto"
    compile_step: CompileStep = "off"

    def __post_init__(self) -> None:
        python_numbers(self)
        self._check_solver()

    def adam_options(self) -> MomentOptions:
        """The moment fields Adam itself reads (β₁, β₂, ε, bias correction, Nesterov) as
        :class:`~dkfac.solvers.MomentOptions`, every basis option at its default."""
        return MomentOptions(
            beta1=self.moment_beta1,
            beta2=self.moment_beta2,
            eps=self.moment_eps,
            bias_correction=self.moment_bias_correction,
            nesterov=self.moment_nesterov,
        )

    def _check_solver(self) -> None:
        check_choice("method", self.method, method_names())
        check_schedules(self, ("damping", "bn_damping", "kl_clip", "lr"), ("bn_damping", "kl_clip"))
        check_dtype("eigen_dtype", self.eigen_dtype, allowed=(torch.float32, torch.float64))
        for name in ("moment_beta1", "moment_beta2"):
            check_range(name, getattr(self, name), low=0.0, low_inclusive=True, high=1.0)
        check_range("moment_eps", self.moment_eps, low=0.0)
        check_bool("moment_bias_correction", self.moment_bias_correction)
        check_bool("moment_nesterov", self.moment_nesterov)
        check_bool("orthogonal_input_rms", self.orthogonal_input_rms)
        check_choice("basis_refresh", self.basis_refresh, BASIS_REFRESHES)
        check_choice("moment_carry", self.moment_carry, MOMENT_CARRIES)
        check_int("basis_max_dim", self.basis_max_dim, optional=True)
        check_dtype("rotation_dtype", self.rotation_dtype, auto=True)
        maps = check_input_maps("flattened_inputs", self.flattened_inputs)
        object.__setattr__(self, "flattened_inputs", maps)
        patterns = check_patterns("orthogonal_layers", self.orthogonal_layers)
        object.__setattr__(self, "orthogonal_layers", patterns)
        check_range("orthogonal_rms", self.orthogonal_rms, low=0.0)
        check_int("orthogonal_steps", self.orthogonal_steps, high=ORTHOGONAL_STEPS_MAX)
        for name in ("orthogonal_split", "orthogonal_rms_power"):
            check_range(
                name,
                getattr(self, name),
                low=0.0,
                high=1.0,
                low_inclusive=True,
                high_inclusive=True,
            )
        changed = [
            name
            for name, value, default in (
                ("orthogonal_rms", self.orthogonal_rms, ORTHOGONAL_RMS),
                ("orthogonal_rms_power", self.orthogonal_rms_power, 0.0),
                ("orthogonal_input_rms", self.orthogonal_input_rms, False),
                ("orthogonal_steps", self.orthogonal_steps, NS_STEPS),
                ("orthogonal_split", self.orthogonal_split, 0.0),
            )
            if value != default
        ]
        if changed and not patterns:
            raise ValueError(
                f"{' and '.join(changed)} set{'s' if len(changed) == 1 else ''} the update of "
                "orthogonal_layers, which names no layer: name the layers or drop the option"
            )
        lowered = (torch.bfloat16, torch.float32, torch.float64)
        check_dtype(
            "gradient_rotation_dtype", self.gradient_rotation_dtype, allowed=lowered, auto=True
        )
        check_int("power_rank", self.power_rank, optional=True)
        block, widest = self.basis_block_size, self.basis_max_dim
        if block != BLOCK_WIDTHS:
            try:
                check_int("basis_block_size", block, optional=True)
            except ValueError:
                raise ValueError(
                    f"basis_block_size must be None, {BLOCK_WIDTHS!r} or an integer >= 1, "
                    f"got {shown(block)}"
                ) from None
        if isinstance(block, int) and widest is not None and block >= widest:
            raise ValueError(
                f"basis_block_size {block} >= basis_max_dim {widest}: every side wider than "
                "the block is wider than basis_max_dim, so one-sided, and no basis would get "
                "blocks; use a block smaller than basis_max_dim or drop one of them"
            )
        check_choice("leftover_update", self.leftover_update, LEFTOVER_UPDATES)
        check_choice("compile_moments", self.compile_moments, COMPILE_MOMENTS)
        check_choice("compile_step", self.compile_step, COMPILE_STEPS)
        if self.leftover_update == "adam" and not adam_scaled(self.method):
            scaled = [m for m in method_names() if adam_scaled(m)]
            raise ValueError(
                "leftover_update 'adam' gives the parameters no block takes Adam's direction, "
                f"at the scale of the updates of {' or '.join(map(repr, scaled))}, got method "
                f"{self.method!r}: use 'gradient' (or 'auto'), or an Adam inner optimizer"
            )
        check_moment_combinations(
            basis_refresh=self.basis_refresh,
            carry=self.moment_carry,
            gradient_rotation_dtype=self.gradient_rotation_dtype,
            power_rank=self.power_rank,
            carry_name="moment_carry",
            orthogonal_rms_power=self.orthogonal_rms_power,
            orthogonal_split=self.orthogonal_split,
        )
        for name, value in (
            ("flattened_inputs", maps),
            ("orthogonal_layers", patterns),
            ("gradient_rotation_dtype", self.gradient_rotation_dtype),
            ("rotation_dtype", self.rotation_dtype),
            ("basis_max_dim", self.basis_max_dim),
            ("power_rank", self.power_rank),
            ("basis_block_size", self.basis_block_size),
        ):
            if value and self.method in METHODS and self.method not in MOMENT_METHODS:
                raise ValueError(
                    f"{name} needs method {' or '.join(map(repr, MOMENT_METHODS))} "
                    f"(a basis of moments), got method {self.method!r}"
                )
        self._check_unread_moment_options()

    def _check_unread_moment_options(self) -> None:
        """A moment option moved from its default where the (built-in) method never reads
        it is an error, not a silent no-op (:func:`unread_moment_fields`)."""
        defaults = {f.name: f.default for f in fields(SolverConfig)}
        unread = unread_moment_fields(self.method)
        moved = [name for name in unread if getattr(self, name) != defaults[name]]
        if moved:
            readers = [m for m in MOMENT_METHODS if not set(moved) & set(unread_moment_fields(m))]
            raise ValueError(
                f"{', '.join(moved)} {'is' if len(moved) == 1 else 'are'} not read by method "
                f"{self.method!r}: drop {'it' if len(moved) == 1 else 'them'} or use "
                f"{' or '.join(map(repr, readers))}"
            )


def leftover_adam(config: SolverConfig) -> bool:
    """Whether the parameters no block takes get Adam's moments (``leftover_update``)."""
    if config.leftover_update == "auto":
        return adam_scaled(config.method)
    return config.leftover_update == "adam"


def unread_moment_fields(method: str) -> tuple[str, ...]:
    """The moment fields of :class:`SolverConfig` that the built-in ``method`` never reads:
    all of :data:`UNREAD_WITHOUT_MOMENTS` without a basis of moments, the first moment's
    (``moment_beta1``, ``moment_nesterov``) and ``moment_eps`` with ``"ekfac"`` (which
    divides by ``v̂ + damping``), none with ``"eigen_adam"`` or a registered custom solver
    (whose use of them the config cannot know)."""
    if method == "ekfac":
        return ("moment_beta1", "moment_nesterov", "moment_eps")
    if method in METHODS and method not in MOMENT_METHODS:
        return UNREAD_WITHOUT_MOMENTS
    return ()
