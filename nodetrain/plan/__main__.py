"""``python -m nodetrain.plan``: print the plan of the composed config (see :mod:`nodetrain.plan.planner`).

The entry point lives here, not in the planner, so the planner never imports its report (the report
imports the planner's ``Plan``): no circle.
"""

import sys

import hydra
from omegaconf import DictConfig

from nodetrain.config.registry import register_configs, to_typed
from nodetrain.config.schema import CONFIG_DIR, ConfigError
from nodetrain.plan.planner import make_plan
from nodetrain.plan.report import render
from nodetrain.run.jobs import exit_process


@hydra.main(config_path=str(CONFIG_DIR), config_name="plan", version_base="1.3")
def main(dict_cfg: DictConfig) -> None:
    """Hydra entry: print the plan of the composed config (same keys as training, plus ``hardware``)."""
    try:
        plan = make_plan(to_typed(dict_cfg))
    except ConfigError as e:  # a user's mistake: the message, not a traceback
        print(f"ConfigError: {e}", file=sys.stderr)
        sys.exit(2)
    render(plan)


if __name__ == "__main__":
    register_configs()
    main()
    exit_process(0)  # printed: skip the interpreter's teardown (run/jobs.py)
