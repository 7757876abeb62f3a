"""Config problems spell values as the config does (config/checks.py's ``Problems``, used by the
one-field rules of config/fields.py too): ``true``/``false``, not Python's ``True``/``False``."""

from __future__ import annotations

import re

import pytest

from nodetrain.config.checks import ConfigError, Problems, validate
from nodetrain.config.schema import Config


def _message(cfg: Config) -> str:
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    return str(err.value)


def test_booleans_are_spelled_true_and_false_in_every_problem() -> None:
    cfg = Config()
    cfg.optim.on_device, cfg.optim.state, cfg.train.dtype = True, "lean", "bfloat16"
    cfg.train.micro_batch_size = False  # fields.py: neither an integer nor auto
    cfg.store.tier, cfg.store.tier_buffers = "nvme", True  # tier_checks.py
    message = _message(cfg)
    for line in (
        "optim.on_device=true: keeps fp32 master weights and moments on the device, optim.state=lean",
        "train.micro_batch_size=false: must be an integer or auto",
        "store.tier_buffers=true: must be an integer >= 2",
    ):
        assert f"  - {line}" in message, message
    assert not re.search(r"=(True|False)\b", message), message


def test_other_values_keep_their_spelling() -> None:
    problems = Problems()
    problems.add("a", None, "x", "y")
    problems.add("b", "", "x", "y")
    problems.add("c", 0, "x", "y")
    problems.add("d", 1.5, "x", "y")
    problems.add("e", "True", "x", "y")  # a string stays as typed
    assert problems == ["a=<unset>: x; y", "b='': x; y", "c=0: x; y", "d=1.5: x; y", "e=True: x; y"]
