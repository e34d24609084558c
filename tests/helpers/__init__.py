"""What more than one test module needs: tiny models, the greedy and sampling checks, random
draft adapters, the tuner's study helpers and the zero-install runner. Imported as `helpers`
(pyproject.toml puts tests/ on the path), so no test module imports from another."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
