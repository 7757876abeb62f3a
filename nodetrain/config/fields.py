"""One-field rules of the config: the helpers that put a range or a choice list on a schema field, and
the walk that checks them.

Owns: :func:`checked` (a dataclass ``field`` whose metadata carries its :class:`Rule` s and, for the
keys that accept it, the fix of a wrong ``auto``), the rule makers (:func:`rule`, :func:`at_least`,
:func:`in_range`, :func:`one_of`, :func:`auto_or_bool`, :func:`not_empty`), and :func:`check_fields`,
which walks every section of a config and adds one problem per bad key (and per non-finite float).
The rules themselves sit on the fields (config/schema.py, config/hardware.py). Does not own rules
between keys, the model shape or the world size (checks.py, which runs this first and raises the one
``ConfigError``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # checks.py imports this module: types only, no runtime import back
    from nodetrain.config.checks import Problems

__all__ = [
    "Rule",
    "at_least",
    "auto_or_bool",
    "check_fields",
    "checked",
    "float_fields",
    "in_range",
    "not_empty",
    "one_of",
    "rule",
    "rules_of",
]


class Rule(NamedTuple):
    """One check of one field: ``ok(value)``, else the problem ``what`` with its ``fix``."""

    ok: Callable[[Any], bool]
    what: str
    fix: str


def rule(ok: Callable[[Any], bool], what: str, fix: str) -> Rule:
    return Rule(ok, what, fix)


def at_least(low: float, fix: str) -> Rule:
    """``value >= low``."""
    return Rule(lambda v: v >= low, f"must be >= {low:g}", fix)


def above(low: float, fix: str) -> Rule:
    """``value > low``."""
    return Rule(lambda v: v > low, f"must be > {low:g}", fix)


def in_range(
    low: float, high: float, fix: str, *, closed_low: bool = True, closed_high: bool = False
) -> Rule:
    """``low <= value < high`` (brackets as ``closed_low`` / ``closed_high`` say)."""

    def ok(v: Any) -> bool:
        return (v >= low if closed_low else v > low) and (v <= high if closed_high else v < high)

    span = f"{'[' if closed_low else '('}{low:g}, {high:g}{']' if closed_high else ')'}"
    return Rule(ok, f"must be in {span}", fix)


def one_of(choices: tuple[str, ...], fix: str = "pick one") -> Rule:
    shown = ", ".join(c if c else "''" for c in choices)
    return Rule(lambda v: v in choices, f"not one of {shown}", fix)


def auto_or_bool(fix: str) -> Rule:
    return Rule(lambda v: isinstance(v, bool) or v == "auto", "not one of true, false, auto", fix)


def not_empty(fix: str) -> Rule:
    return Rule(bool, "must not be empty", fix)


def checked(default: Any = dataclasses.MISSING, *rules: Rule, auto: str = "", default_factory=None) -> Any:
    """A dataclass field with its one-field ``rules`` (checked by :func:`check_fields`). ``auto``: the
    key also accepts ``auto`` (resolved by ``core.run_shape.resolve`` before anything reads it), and
    this is the fix of a value that is neither ``auto`` nor an integer."""
    metadata = {"rules": rules, "auto": auto}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def rules_of(f: dataclasses.Field) -> tuple[Rule, ...]:
    """The rules :func:`checked` put on a field (none for a plain field)."""
    return f.metadata.get("rules", ())


def float_fields(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every ``float`` field of a config dataclass, nested ones included."""
    found = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            found += float_fields(value, f"{prefix}{f.name}.")
        elif f.type in ("float", float):
            found.append((f"{prefix}{f.name}", value))
    return found


def _check_section(obj: Any, prefix: str, infinite: set[str], problems: Problems) -> None:
    for f in dataclasses.fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_section(value, f"{key}.", infinite, problems)
            continue
        if value == "???" or key in infinite:  # MISSING (a profile not composed), or reported already
            continue
        auto = f.metadata.get("auto")
        if auto and value == "auto":
            continue
        if auto and (isinstance(value, bool) or not isinstance(value, int)):
            problems.add(key, value, "must be an integer or auto", auto)
            continue
        for ok, what, fix in rules_of(f):
            if not ok(value):
                problems.add(key, value, what, fix)


def check_fields(cfg: Any, problems: Problems) -> set[str]:
    """Walk every section of ``cfg`` and add a problem for every non-finite float and every key outside
    its own rules (``???``, a hardware profile the caller did not compose, is skipped). Returns the
    non-finite keys (rules between keys leave them alone: they are reported once already)."""
    infinite = set()
    for key, value in float_fields(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            problems.add(
                key, value, "must be a finite number", "give a finite value (nodetrain/config/schema.py)"
            )
            infinite.add(key)
    _check_section(cfg, "", infinite, problems)
    return infinite
