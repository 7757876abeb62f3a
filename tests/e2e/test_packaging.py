"""A regular ``pip install .`` (not only an editable one) ships the configs: the built wheel holds
every ``conf/`` YAML as ``nodetrain/conf/``, and the installed package composes its config from there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_conf_and_the_installed_package_composes_from_it(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a clean copy: a build/ left in the checkout would hide a missing file
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "nodetrain", "conf"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, src / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*cmd, "-w", str(tmp_path), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("nodetrain-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {f"nodetrain/conf/{p.relative_to(ROOT / 'conf')}" for p in (ROOT / "conf").rglob("*.yaml")}
    assert len(want) > 20 and want <= names, sorted(want - names)

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # what pip install puts in site-packages
    probe = (
        "from hydra import compose, initialize_config_dir\n"
        "from nodetrain.config.schema import CONFIG_DIR, validate\n"
        "from nodetrain.config.registry import register_configs, to_typed\n"
        "register_configs()\n"
        "with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base='1.3'):\n"
        "    cfg = to_typed(compose('config'))\n"
        "validate(cfg, world_size=2)\n"
        "print(CONFIG_DIR, cfg.model.name)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [str(site / "nodetrain" / "conf"), "llama_10m"]
