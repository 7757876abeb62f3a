"""The torch and transformers versions nodetrain supports, and the start-up check that refuses others.

Owns: the supported range of each (DESIGN.md invariant 10: GPU nodes lag the CPU machines; our GPU
test machine had torch 2.11 and transformers 5.17 when the CPU machines had 2.13.0 and 5.24) and
the check ``import nodetrain`` runs before any subsystem touches either library. pyproject.toml
states the same range (``[tool.nodetrain.supported]`` and the ``transformers`` dependency; a test
keeps them equal). CI runs the suite on the newest transformers and the model tests on the oldest
(``.ci/run``).

Versions are read from the installed distributions' metadata (``importlib.metadata``: no torch or
transformers import). Only the release numbers count, so a pre-release or local build of a
supported release passes: NGC containers ship torch as ``2.11.0a0+<commit>``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re

__all__ = ["SUPPORTED", "check_versions", "installed_versions", "release", "spec", "unsupported"]

SUPPORTED = {"torch": ("2.11", "3"), "transformers": ("5.17.0", "6")}
"""Distribution → (oldest supported release, first unsupported release): ``oldest <= v < first``."""


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string, three places: ``"2.11.0a0+git1"`` → ``(2, 11, 0)``.

    Raises:
        ValueError: ``version`` does not start with a number.
    """
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    if match is None:
        raise ValueError(f"{version!r} is not a version number")
    numbers = tuple(int(n) for n in match.group().split("."))
    return (*numbers, 0, 0, 0)[:3]


def spec(name: str) -> str:
    """The supported range of ``name`` as a pip requirement specifier: ``">=5.17.0,<6"``."""
    oldest, first_unsupported = SUPPORTED[name]
    return f">={oldest},<{first_unsupported}"


def installed_versions() -> dict[str, str]:
    """Distribution → its installed version, for each name of :data:`SUPPORTED`.

    From the distribution's metadata, else (a source build without metadata) the module's
    ``__version__``.
    """
    versions = {}
    for name in SUPPORTED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = importlib.import_module(name).__version__
    return versions


def unsupported(versions: dict[str, str]) -> list[str]:
    """One line per version of ``versions`` outside its supported range, with the fix; [] if none.

    Args:
        versions: distribution name (a key of :data:`SUPPORTED`) → version string.
    """
    problems = []
    for name, version in versions.items():
        oldest, first_unsupported = SUPPORTED[name]
        if not release(oldest) <= release(version) < release(first_unsupported):
            fix = f"pip install '{name}{spec(name)}'"
            if name == "torch":
                fix += " (on a GPU node, the CUDA build of that range that matches its driver)"
            supports = f"nodetrain supports {name}{spec(name)}"
            problems.append(f"{name} {version} is installed; {supports}. Fix: {fix}")
    return problems


def check_versions(versions: dict[str, str] | None = None) -> None:
    """Refuse to start outside the supported range (run by ``import nodetrain``).

    Args:
        versions: distribution → version; None reads the installed ones (:func:`installed_versions`).

    Raises:
        ImportError: a version outside :data:`SUPPORTED`; the message names each such version, the
            supported range and the ``pip install`` that fixes it.
    """
    problems = unsupported(installed_versions() if versions is None else versions)
    if problems:
        raise ImportError("nodetrain cannot start on this software:\n  " + "\n  ".join(problems))
