"""The engine: what runs a K-FAC step and joins the three axes (blocks, solvers, strategies).

Registration (:mod:`.registration`) and what each parameter gets (:mod:`.coverage`), guards
against misuse (:mod:`.guards`), per-layer state (:mod:`.layer_state`), the capture
hooks (:mod:`.capture`) and Monte-Carlo Fisher targets (:mod:`.fisher`), the step math
(:mod:`.step_math`) and its NaN/Inf test (:mod:`.finite`), which devices take their
multi-tensor forms (:mod:`.launches`), the refresh policy and its
agreement (:mod:`.refresh`, :mod:`.refresh_step`), presence agreement and overlapped
reduction (:mod:`.presence`, :mod:`.eager`) and preconditioner checkpoints
(:mod:`.checkpoint`). The public face is :class:`dkfac.KFACPreconditioner`.
"""
