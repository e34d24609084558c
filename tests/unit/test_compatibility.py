"""Importing hf_selfspec warns when the installed transformers is outside the declared range."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from importlib.metadata import PackageNotFoundError

import pytest

import hf_selfspec
from hf_selfspec import compatibility

pytestmark = pytest.mark.version_sensitive

WARNING_START = "hf-selfspec was tested with transformers"


def test_the_installed_transformers_is_inside_the_declared_range():
    # Run in a fresh interpreter, where the import is not cached, with this warning made an error:
    # CI installs two transformers versions (make test, make test-lowest-transformers), so this also
    # checks that both are ones pyproject.toml admits.
    completed = subprocess.run(
        [sys.executable, "-W", f"error:{WARNING_START}:UserWarning", "-c", "import hf_selfspec"],
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 0, completed.stderr


@pytest.mark.parametrize("installed", ["5.25.0", "5.22.1", "6.0.0"])
def test_a_version_outside_the_range_is_named_with_the_range(monkeypatch, installed):
    monkeypatch.setattr(compatibility, "version", lambda distribution: installed)
    with pytest.warns(UserWarning, match=WARNING_START) as caught:
        compatibility.warn_if_transformers_untested()
    message = str(caught[0].message)
    assert f"transformers {installed} is installed" in message
    assert str(compatibility.declared_requirements()["transformers"].specifier) in message


def test_importing_the_package_warns(monkeypatch):
    monkeypatch.setattr(compatibility, "version", lambda distribution: "5.25.0")
    with pytest.warns(UserWarning, match=WARNING_START) as caught:
        importlib.reload(hf_selfspec)
    # It points at our package's import, the line a user can find, not at the check's own module.
    assert caught[0].filename == hf_selfspec.__file__


def test_a_checkout_that_was_never_installed_is_not_checked(monkeypatch):
    def not_installed(distribution):
        raise PackageNotFoundError(distribution)

    monkeypatch.setattr(compatibility, "requires", not_installed)
    monkeypatch.setattr(compatibility, "version", lambda distribution: "0.0.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compatibility.warn_if_transformers_untested()


def test_the_declared_requirements_leave_the_extras_out():
    declared = compatibility.declared_requirements()
    assert {"torch", "transformers"} <= declared.keys()
    assert "optuna" not in declared  # declared only for the `tuning` extra
