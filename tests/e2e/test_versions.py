"""The supported torch and transformers range (DESIGN.md invariant 10, issue 19).

pyproject.toml states the range the start-up check enforces; ``import nodetrain`` refuses a version
outside it, naming the version and the fix; and the environment under test is the one CI asked for
(``.ci/run``'s oldest-transformers leg sets ``NODETRAIN_CI_TRANSFORMERS``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from nodetrain.config.versions import SUPPORTED, check_versions, installed_versions, release, spec

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_states_the_range_the_check_enforces() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["nodetrain"]["supported"] == {name: spec(name) for name in SUPPORTED}
    deps = project["project"]["dependencies"]
    assert f"transformers{spec('transformers')}" in deps
    (torch_pin,) = [d for d in deps if d.startswith("torch")]  # the CPU machines' wheel
    oldest, first_unsupported = SUPPORTED["torch"]
    assert release(oldest) <= release(torch_pin.removeprefix("torch==")) < release(first_unsupported)


@pytest.mark.parametrize(
    ("version", "as_release"),
    [
        ("2.11", (2, 11, 0)),
        ("2.11.0a0+git5c9ba7e", (2, 11, 0)),
        ("5.17.0.dev0", (5, 17, 0)),
        ("6", (6, 0, 0)),
    ],
)
def test_release_keeps_the_release_numbers(version: str, as_release: tuple[int, ...]) -> None:
    assert release(version) == as_release


@pytest.mark.parametrize(
    "versions",
    [
        {"torch": "2.11.0a0+git5c9ba7e", "transformers": "5.17.0"},  # an NGC container's torch
        {"torch": "2.13.0+cpu", "transformers": "5.24.0"},
        {"torch": "2.99.1", "transformers": "5.99.0"},
    ],
)
def test_versions_in_the_range_start(versions: dict[str, str]) -> None:
    check_versions(versions)


@pytest.mark.parametrize(
    ("name", "version"),
    [("torch", "2.10.2+cu126"), ("torch", "3.0.0"), ("transformers", "5.16.1"), ("transformers", "6.0.0")],
)
def test_a_version_outside_the_range_is_refused_naming_it_and_the_fix(name: str, version: str) -> None:
    versions = {"torch": "2.13.0", "transformers": "5.24.0", name: version}
    with pytest.raises(ImportError) as refused:
        check_versions(versions)
    message = str(refused.value)
    assert f"{name} {version} is installed" in message
    assert f"Fix: pip install '{name}{spec(name)}'" in message
    assert message.count("is installed") == 1  # the supported one is not named


def test_import_nodetrain_refuses_an_old_transformers(tmp_path: Path) -> None:
    """End to end: a transformers 5.16.0 first on the path stops ``import nodetrain`` itself."""
    dist = tmp_path / "transformers-5.16.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 5.16.0\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-c", "import nodetrain"], capture_output=True, text=True, env=env)
    assert proc.returncode != 0
    assert "ImportError: nodetrain cannot start on this software" in proc.stderr
    assert "transformers 5.16.0 is installed; nodetrain supports transformers>=5.17.0,<6" in proc.stderr


def test_this_environment_is_supported_and_the_one_ci_asked_for() -> None:
    """Under ``.ci/run``'s oldest leg the transformers imported is the oldest supported one."""
    installed = installed_versions()
    check_versions(installed)
    expected = os.environ.get("NODETRAIN_CI_TRANSFORMERS")
    if expected is not None:
        assert expected == SUPPORTED["transformers"][0]
        assert transformers.__version__ == installed["transformers"] == expected
