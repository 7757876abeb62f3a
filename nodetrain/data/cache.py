"""Where prepared datasets live: ``data.dir``, else a cache folder of the user's, as ``datasets`` and
``transformers`` keep theirs (``~/.cache/huggingface``).

Owns: the one rule that turns ``data.dir`` into the root every prepared dataset goes under
(``datasets.prepare``: token streams; ``sft.prepare_records``: packed records). Does not own what
goes into that root (datasets.py, sft.py) nor removing anything from it: a user deletes the folder to
reclaim the space, and the next run prepares what it needs again.

    root = data_root(cfg.data.dir)   # "" -> $NODETRAIN_CACHE/data, else $XDG_CACHE_HOME/nodetrain/data,
                                     #       else ~/.cache/nodetrain/data
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV", "cache_home", "data_root"]

CACHE_ENV = "NODETRAIN_CACHE"
"""Environment variable naming nodetrain's cache folder (prepared datasets go to its ``data/``)."""


def cache_home() -> Path:
    """nodetrain's cache folder: ``$NODETRAIN_CACHE``, else ``$XDG_CACHE_HOME/nodetrain``, else
    ``~/.cache/nodetrain`` (the XDG base directory rule ``huggingface_hub`` follows too); absolute."""
    if given := os.environ.get(CACHE_ENV, ""):
        return Path(given).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return (base / "nodetrain").absolute()


def data_root(data_dir: str) -> Path:
    """The absolute root of the prepared datasets for ``data.dir``: the directory it names (relative
    to the current directory), or, empty, ``cache_home() / "data"``."""
    if data_dir:
        return Path(data_dir).expanduser().absolute()
    return cache_home() / "data"
