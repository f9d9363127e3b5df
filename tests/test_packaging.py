"""A built wheel carries what a non-editable install needs: the configs and the embedded model."""

from __future__ import annotations

import pytest

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_carries_configs_and_model_and_loads_them(tmp_path):
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = out.glob("omnirl_async-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "omnirl_async/configs/diffusion_trainer.yaml" in names
    assets = [p.relative_to(ROOT).as_posix() for p in (ROOT / "omnirl_async" / "assets").rglob("*") if p.is_file()]
    assert sum(a.endswith(".safetensors") for a in assets) == 4
    assert set(assets) <= names, sorted(set(assets) - names)
    assert not any(n.startswith("tests/") for n in names)

    # unpacked away from the repository (no configs/ beside it), the config loader finds the package's copy
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {k: v for k, v in os.environ.items() if k != "OMNIRL_CONFIG_DIR"}
    env["PYTHONPATH"] = str(site)
    code = ("import omnirl_async, sys; from omnirl_async.config import load_config; "
            "from omnirl_async.config.loader import default_config_dir; "
            "cfg = load_config(['actor_rollout_ref.rollout.n=3']); "
            "print(omnirl_async.__file__, default_config_dir(), cfg.actor_rollout_ref.model.path, cfg.actor_rollout_ref.rollout.n)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    module_file, config_dir, model_path, n = res.stdout.split()
    assert module_file.startswith(str(site)) and config_dir == str(site / "omnirl_async" / "configs")
    assert model_path == "embedded:shapes" and n == "3"
