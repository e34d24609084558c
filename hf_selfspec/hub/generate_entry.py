"""`custom_generate/generate.py` of a folder written by `hf-selfspec package`, copied verbatim.

transformers calls `generate(model=..., **generate's own arguments)` when a user passes
`custom_generate=<folder or repo>` (or loads a model repo holding this file with
`trust_remote_code=True`). The decoding core sits beside this file, copied from hf_selfspec, so
the user needs nothing installed but transformers. It is not imported where it lies in the
package: its relative imports resolve only among the copied modules.
"""

from __future__ import annotations

from .bundled_profiles import PROFILES
from .mixin import SelfSpecMixin, enabled_class
from .profiles import PROFILE_KEY, read_profiles


def generate(*args, model, **kwargs):
    """`hf_selfspec.enable(model).generate(*args, **kwargs)`, for this call only.

    `model` is keyword-only: a model repo binds it with `functools.partial`, so a user's
    positional input ids arrive in `args`. The model's class is swapped back afterwards, so its
    plain `generate` stays plain; one already enabled by an installed hf_selfspec is swapped from
    its transformers class, as two mixins would each plan the call. The profiles packaged with
    this file are lent to a generation config that has none.
    """
    original_class = type(model)
    transformers_class = next(cls for cls in original_class.__mro__ if not hasattr(cls, "_plan_strategy"))
    config = model.generation_config
    lend_profiles = not read_profiles(config)
    if lend_profiles:
        setattr(config, PROFILE_KEY, PROFILES)
    model.__class__ = enabled_class(transformers_class)
    try:
        # Named explicitly: a model repo's `model.generate` is this function again.
        return SelfSpecMixin.generate(model, *args, **kwargs)
    finally:
        model.__class__ = original_class
        if lend_profiles:
            delattr(config, PROFILE_KEY)
