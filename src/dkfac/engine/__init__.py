"""The engine: what runs a K-FAC step and joins the three axes (blocks, solvers, strategies).

The checks on what callers pass (:mod:`.arguments`) and on a :class:`dkfac.KFACOptimizer`'s
parameter groups (:mod:`.param_groups`), registration (:mod:`.registration`) and
what each parameter gets (:mod:`.coverage`), how the parts are put together
(:mod:`.assembly`), guards against misuse (:mod:`.guards`), per-layer state
(:mod:`.layer_state`), the capture hooks (:mod:`.capture`) and Monte-Carlo Fisher targets
(:mod:`.fisher`), the work of each step phase (:mod:`.step_phases`) over the step math
(:mod:`.step_math`) and its NaN/Inf test (:mod:`.finite`), which devices take their
multi-tensor forms (:mod:`.launches`), the refresh policy and its
agreement (:mod:`.refresh`, :mod:`.refresh_step`), presence agreement and overlapped
reduction (:mod:`.presence`, :mod:`.eager`), the overhead budget's application
(:mod:`.budget_apply`), what a preconditioner reports (:mod:`.introspection`) and
preconditioner checkpoints (:mod:`.saved_state`, :mod:`.checkpoint`). The public face is
:class:`dkfac.KFACPreconditioner`.
"""
