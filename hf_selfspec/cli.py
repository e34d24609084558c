"""`hf-selfspec`: one command, with a subcommand per job.

Each job owns its module and registers its own subparser; this file only wires them together,
so the tuner's dependencies (optuna, the dashboard, the Hub client) load only when used.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module defining `add_parser(subparsers)`; each sets `func` on its parser.
_COMMANDS = {
    "bench": "hf_selfspec.bench.cli",
    "package": "hf_selfspec.hub.cli",
    "tune": "hf_selfspec.tuning.cli",
    "dashboard": "hf_selfspec.tuning.cli",
    "export": "hf_selfspec.tuning.cli",
    "push": "hf_selfspec.tuning.cli",
    "quickstart": "hf_selfspec.tuning.cli",
    "optimize": "hf_selfspec.tuning.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-selfspec",
        description="Lossless self-speculative decoding for transformers models: "
        "benchmark the strategies, tune their skip sets with Optuna, export and share the result.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in dict.fromkeys(_COMMANDS.values()):
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            missing = getattr(error, "name", None) or str(error)
            for command in [c for c, m in _COMMANDS.items() if m == module_name]:
                stub = subparsers.add_parser(command, help=f"(unavailable: {missing} is not installed)")
                stub.set_defaults(func=_missing_dependency(command, missing))
            continue
        module.add_parser(subparsers)
    return parser


def _missing_dependency(command: str, missing: str):
    def fail(_args: argparse.Namespace) -> int:
        print(
            f"hf-selfspec {command} needs {missing}. Install the extras with: pip install 'hf-selfspec[tuning,bench]'",
            file=sys.stderr,
        )
        return 2

    return fail


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
