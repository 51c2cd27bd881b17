"""The checkpoint layout engines load, from what a transformers model holds in memory.

transformers 5 converts some checkpoints as it loads them and converts them back as
``save_pretrained`` writes them: a Qwen3-MoE's experts are one fused
``mlp.experts.gate_up_proj`` [E, 2*I, H] in memory and ``mlp.experts.N.gate_proj.weight``
per expert on the Hub, a Qwen2.5-VL's language model lives under ``model.language_model.``
in memory and ``model.`` on disk. vLLM and SGLang load the Hub layout, so a version must
hold the tensors ``save_pretrained`` would write, under those names: transformers' own
``revert_weight_conversion`` with the model's own conversions does exactly that (a split of
fused experts is a view per expert; a rename is free). Models without conversions, and
transformers releases without the machinery, pass through unchanged.
"""
from __future__ import annotations

import torch

# Wrappers around a whole model (DDP, torch.compile, accelerate): the model is an attribute.
_WRAPPED = ("module", "_orig_mod")


def transformers_model(obj) -> torch.nn.Module | None:
    """The transformers ``PreTrainedModel`` ``obj`` is or wraps (DDP, ``torch.compile``), else None."""
    for _ in range(4):
        if type(obj).__module__.startswith("transformers.") and hasattr(obj, "config") and hasattr(obj, "state_dict"):
            return obj
        obj = next((getattr(obj, a) for a in _WRAPPED if isinstance(getattr(obj, a, None), torch.nn.Module)), None)
        if obj is None:
            return None
    return None


def to_checkpoint_layout(state: dict[str, torch.Tensor], model: torch.nn.Module | None) -> dict[str, torch.Tensor]:
    """``state`` (names and layout as ``model`` holds them in memory) in the layout its checkpoints
    have on disk; unchanged without a model, or where transformers has no conversion to revert."""
    if model is None:
        return state
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: what a model holds is what it saves
        return state
    return dict(revert_weight_conversion(model, dict(state)))


__all__ = ["transformers_model", "to_checkpoint_layout"]
