"""Planner: the cost model (``costs``: memory, traffic, step time), the plan (``planner``,
``python -m nodetrain.plan``) and its printed report (``report``).
Must not import train; ``costs`` (used by ``engine.residency``) imports no engine module at load time;
the planner never imports its report (the CLI in ``__main__`` imports both).
"""
