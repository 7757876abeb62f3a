"""Planner: will a config fit a node and how fast will it train: the plan (``planner``), its verdict
(``verdict``) and report (``report``), ``python -m nodetrain.plan`` (``__main__``), and the training
start-up host check (``host``). Stands on ``core/`` (every choice, resolved as the engine resolves it)
and ``cost/`` (the arithmetic); never imports the engine or train; ``planner`` never imports ``report``.
"""
