"""`hf-selfspec package`. Only argument wiring lives here: the work is in `package`, which
`hf-selfspec export --custom-generate` calls as well."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DESCRIPTION = """\
Write DIR so that transformers alone runs the tuned profiles of a generation_config.json:
  DIR/generation_config.json    the config, profiles included
  DIR/NAME.safetensors, .json   the draft adapters and lookup corpora its profiles name, at the same relative names
  DIR/custom_generate/          generate.py, the decoding core it imports (copied from the
                                installed hf-selfspec), the profiles as a Python module and
                                requirements.txt
  DIR/README.md                 a model card section: each profile's measurements and how to use it
Upload DIR as a repository of its own, or into the model's repository (see `hf-selfspec push
--folder`). DIR may already hold the model: only these files change, and an existing README.md
keeps everything outside its hf-selfspec section.
"""

EPILOG = """\
then, with nothing but transformers installed:
  model.generate(**inputs, custom_generate="DIR or org/repo", trust_remote_code=True)
or, with DIR holding the model's weights too:
  AutoModelForCausalLM.from_pretrained("DIR or org/repo", trust_remote_code=True).generate(**inputs)

example:
  hf-selfspec package --config hf_selfspec/data/tuned/smollm2-135m-instruct/generation_config.json --output smollm2-selfspec
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "package",
        help="write a folder that runs the tuned profiles through transformers' custom_generate, nothing installed",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        required=True,
        type=Path,
        metavar="FILE",
        help="a generation_config.json holding tuned profiles, e.g. one written by `hf-selfspec export`",
    )
    parser.add_argument(
        "--output", required=True, type=Path, metavar="DIR", help="directory to write into (created if missing)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .package import PackageError, package, summary

    try:
        result = package(args.config, args.output)
    except PackageError as error:
        print(f"hf-selfspec package: error: {error}", file=sys.stderr)
        return 2
    print(summary(result))
    return 0
