"""A warning when the installed transformers is outside the range this release was tested with.

The strategies take over `generate`'s private `_sample` step and name the cache its own way, so a
transformers minor release we have not tested can break them (5.24's rename of `past_key_values`
made every strategy fail). pip keeps an installed hf-selfspec inside its declared range, but a
`--no-deps` install or a later upgrade of transformers alone (pip only warns of the conflict) can
leave it outside. Then the failure, if one comes, is deep inside generation; this warning names
its likely cause first.

It warns rather than refuses: the verifier is the unchanged model, so an untested version that
runs at all still decodes losslessly, and refusing would block a user who has checked it works.
The zero-install package (`hub/`) does not import this: transformers itself checks that
package's `requirements.txt`.
"""

from __future__ import annotations

import warnings
from importlib.metadata import PackageNotFoundError, requires, version

from packaging.requirements import Requirement

DISTRIBUTION = "hf-selfspec"


def declared_requirements() -> dict[str, Requirement]:
    """What our installed metadata declares we need at run time, by name (the extras' left out).
    Raises PackageNotFoundError from a checkout that was never installed."""
    requirements = (Requirement(line) for line in requires(DISTRIBUTION) or [])
    return {requirement.name: requirement for requirement in requirements if requirement.marker is None}


def warn_if_transformers_untested() -> None:
    try:
        requirement = declared_requirements()["transformers"]
    except PackageNotFoundError:  # a checkout on sys.path: no declared range to compare against
        return
    installed = version("transformers")
    if requirement.specifier.contains(installed, prereleases=True):
        return
    warnings.warn(
        f"hf-selfspec was tested with transformers{requirement.specifier}, but transformers "
        f"{installed} is installed. Its strategies take over transformers' private `_sample` step, "
        f"which changes between minor releases; if a strategy fails or behaves oddly, install a "
        f"tested version: pip install 'transformers{requirement.specifier}'.",
        UserWarning,
        stacklevel=2,
    )
