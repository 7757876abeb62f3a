"""``python -m nodetrain.plan``: print the plan of a config (see :mod:`nodetrain.plan.planner`)."""

from nodetrain.config.schema import register_configs
from nodetrain.plan.planner import main

register_configs()
main()
