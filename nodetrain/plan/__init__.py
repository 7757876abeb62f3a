"""Planner: the cost model (``costs``: memory, traffic, step time), the plan (``planner``) and its
report (``report``); ``python -m nodetrain.plan`` (``__main__``). Must not import train; ``costs`` (also
read by ``engine.residency``) imports no engine module at load time; ``planner`` never imports ``report``.
"""
