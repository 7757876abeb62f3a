"""Engine: one rank's step on its device, driven by the frozen ``core.run_shape.RunShape``.

``engine.py`` the step's order and the thread table (public surface: ``Engine``, ``train_step``,
``close``) · ``stage.py`` a stage's forward/backward · ``step_batch.py`` a step's batch on the device ·
``linear_ce.py`` the chunked head and loss · ``threads.py`` who writes what · ``startup.py`` measures
the machine, resolves the run and opens the store and optimizer (``build_engine``). Grouped by what
it drives: ``device/`` (window, copy workers, staging, activation offload), ``host/`` (gradient
accumulation, the optimizer thread, readiness, thread binding, start-up measurements, the NVMe tier)
and ``comm/`` (collectives on the right device, P2P pairing, replicas). Decides nothing the planner
prices: those rules are ``core/``'s, the arithmetic ``cost/``'s. Never imports ``plan`` or ``train``.
"""
