"""Engine: one rank's step: step order and the thread table (``engine``), the step's schedule
expanded once (``step_plan``), a unit's fwd/bwd (``stage``), the device window (``window``,
``copy_worker``, ``staging``), pipeline schedule and P2P (``pipeline``, ``comm``), when a unit's
gradient is final (``readiness``), what each update mode does (``policy``) and the optimizer thread
that does it (``overlap``), who writes what (``threads``), set-up (``setup``), residency, replicas,
host threads. Must not import plan (except its cost model: ``plan.costs``, ``plan.exposure``,
``plan.step_time``) or train.
"""
