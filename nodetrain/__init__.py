"""nodetrain: one node's LLM trainer, grouped by subsystem from the bottom floor up.

config/ and store.py → model/ → data/, optim/ → checkpoint/ → run/ → engine/ → plan/ → train.py;
a floor imports only its own and lower ones, with no import circles (tests/unit/test_layout.py).

Importing the package first refuses a torch or transformers outside the supported range
(``nodetrain.config.versions``), before any subsystem calls either.
"""

from nodetrain.config.versions import check_versions

check_versions()
