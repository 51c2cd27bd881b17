"""vLLM's side of the post-processing census (:mod:`engine_ext.server.census`): where it is taken, and
what the plugin's patches claim (the copies they refresh after every write)."""

from __future__ import annotations

import torch

from ...server.census import CENSUS_ATTR, keys_of, take
from . import compat


def wrap_post_processing() -> bool:
    """Install the census around vLLM's ``process_weights_after_loading`` (idempotent)."""
    try:
        utils, base_loader = compat.post_processing_modules()
    except ImportError:
        return False
    orig = utils.process_weights_after_loading
    if getattr(orig, CENSUS_ATTR, False):
        return True

    def process_weights_after_loading(model, model_config, target_device):
        take(model, lambda: orig(model, model_config, target_device))

    setattr(process_weights_after_loading, CENSUS_ATTR, True)
    process_weights_after_loading.original = orig
    for mod in (utils, base_loader):
        if getattr(mod, "process_weights_after_loading", None) is orig:
            mod.process_weights_after_loading = process_weights_after_loading
    return True


def claimed(module: torch.nn.Module) -> set[tuple]:
    """The keys of the copies a patch refreshes after every write into ``module``'s weights."""
    from .patches import _captured

    keys: set[tuple] = set()

    def add(obj):
        keys.update(keys_of(obj))

    if getattr(module, "_engine_ext_packed", False):  # the CPU GEMM's packed weight or handle (patches.repack)
        add(_captured(getattr(module, "cpu_linear", None)))
    if getattr(module, "_engine_ext_conv", None) is not None:  # the packed conv1d weight (patches.repack_conv)
        add([module.weight, module.__dict__.get("_cpu_unpacked_conv_weight")])
    if getattr(module, "_engine_ext_mla", None) is not None:  # AMX MLA's packed W_UK/W_UV (patches.rederive_mla)
        from .patches import MLA_PACKED

        add([getattr(module.impl, n, None) for n in MLA_PACKED])
    info = getattr(module, "_engine_ext_moe", None)
    if info is not None:  # packed experts and a padded bias (patches.repack_experts)
        add(list(info["packed"].values()))
    return keys


__all__ = ["claimed", "wrap_post_processing"]
