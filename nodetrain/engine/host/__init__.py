"""Host work of a rank: gradient accumulation into the store (``accumulate``), when a unit's gradient
is final (``readiness``), the optimizer thread (``overlap``), core and NUMA binding (``binding``), the
start-up measurements ``core.run_shape.resolve`` is handed (``measure``) and the NVMe tier's set-up
(``tier_setup``)."""
