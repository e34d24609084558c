"""What a regular install puts in site-packages: everything under `hf_selfspec`, nothing under a
generic top-level name (the tuner's folder is `tuning/`, and an unrelated PyPI package is called
that)."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from helpers import REPO_ROOT


def test_the_wheel_holds_only_hf_selfspec_with_the_tuner_and_the_hub_entry_inside(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", tmp_path, "."],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("hf_selfspec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"hf_selfspec", wheel.name.split("-py")[0] + ".dist-info"}
    for needed in [
        "hf_selfspec/tuning/cli.py",
        "hf_selfspec/tuning/studies/hub.py",
        "hf_selfspec/hub/generate_entry.py",
        "hf_selfspec/data/tuned/smollm2-135m-instruct/generation_config.json",
        "hf_selfspec/data/tuned/smollm2-135m-instruct/own-code.safetensors",
        "hf_selfspec/data/tuned/smollm2-135m-instruct/own-code.json",
    ]:
        assert needed in names
    # Every module of the tuner, its rooms' included (pyproject.toml lists each sub-package).
    tuner = REPO_ROOT / "tuning"
    assert {f"hf_selfspec/tuning/{path.relative_to(tuner).as_posix()}" for path in tuner.rglob("*.py")} <= set(names)
    # Every shipped profile file, each a real file in the package folder that the wheel copies.
    shipped = (REPO_ROOT / "hf_selfspec" / "data" / "tuned").rglob("*")
    assert {path.relative_to(REPO_ROOT).as_posix() for path in shipped if path.is_file()} <= set(names)
