"""``python -m nodetrain.plots RUN_DIR [RUN_DIR ...]``: the entry point of :mod:`nodetrain.run.plots`."""

from nodetrain.run.plots import main

if __name__ == "__main__":
    raise SystemExit(main())
