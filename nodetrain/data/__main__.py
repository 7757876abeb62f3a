"""``python -m nodetrain.data``: prepare a tokenized dataset (see :mod:`nodetrain.data.datasets`)."""

from nodetrain.data.datasets import main

main()
