"""`custom_generate/generate.py` of a folder written by `hf-selfspec package`, copied verbatim.

transformers calls `generate(model=..., **generate's own arguments)` when a user passes
`custom_generate=<folder or repo>` (or loads a model repo holding this file with
`trust_remote_code=True`). The decoding core sits beside this file, copied from hf_selfspec, so
the user needs nothing installed but transformers. It is not imported where it lies in the
package: its relative imports resolve only among the copied modules.
"""

from __future__ import annotations

from .bundled_profiles import FILES_DIR, PROFILES
from .mixin import generate_with_strategy, transformers_class
from .profiles import PROFILE_KEY, read_profiles


def generate(*args, model, strategy=None, **kwargs):
    """`hf_selfspec.enable(model).generate(*args, **kwargs)`, without touching the model.

    `model` is keyword-only: a model repo binds it with `functools.partial`, so a user's
    positional input ids arrive in `args`. Nothing is set on the model, its class included, as
    other threads may be decoding with it; a model already enabled by an installed hf_selfspec
    decodes through its transformers class, as two mixins would each plan the call. The profiles
    packaged with this file serve a model whose generation config has none; the files they name
    are the package's (`FILES_DIR`: the folder, or addresses in its Hub repository).
    """
    plain = transformers_class(model).generate.__get__(model)
    lent = (read_profiles({PROFILE_KEY: PROFILES}), FILES_DIR)
    return generate_with_strategy(model, plain, args, kwargs, strategy, lent_profiles=lent)
