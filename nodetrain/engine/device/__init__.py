"""Device work of a stage: the window its blocks stream through (``window``), the H2D/D2H copy
workers (``copy_worker``), the gradient staging buffers (``staging``) and the activation offload
(``activations``). What to load, offload and keep resident comes from ``core.step_plan`` and
``core.placement``."""
