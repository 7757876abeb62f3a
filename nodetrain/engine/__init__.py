"""Engine: one rank's step: step order (``engine``), a unit's fwd/bwd (``stage``), the device window
(``window``, ``staging``), pipeline schedule and P2P (``pipeline``, ``comm``), optimizer overlap
(``overlap``), residency, replicas, host threads. Must not import plan (except its cost model:
``plan.costs``, ``plan.exposure``, ``plan.step_time``) or train.
"""
