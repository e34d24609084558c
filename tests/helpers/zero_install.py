"""Decoding through a packaged folder in an interpreter that cannot import hf_selfspec."""

from __future__ import annotations

import json
import site
import subprocess
import sys
from pathlib import Path

CHECK_SCRIPT = Path(__file__).with_name("zero_install_check.py")


def run_isolated(tmp_path: Path, **spec) -> dict:
    spec_file = tmp_path / "spec.json"
    # This venv's site directories and any its .pth files add (a worktree's venv may take torch
    # from another venv's): `-S` skips the .pth files, so they are passed by name.
    site_packages = list(dict.fromkeys([*site.getsitepackages(), *(p for p in sys.path if p.endswith("site-packages"))]))
    spec_file.write_text(json.dumps({"site_packages": site_packages, **spec}))
    env = {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-I", "-S", str(CHECK_SCRIPT), str(spec_file)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])
