"""The checkpoint layout engines load, from what a transformers model holds in memory.

transformers 5 converts some checkpoints as it loads them and converts them back as
``save_pretrained`` writes them: a Qwen3-MoE's experts are one fused
``mlp.experts.gate_up_proj`` [E, 2*I, H] in memory and ``mlp.experts.N.gate_proj.weight``
per expert on the Hub, a Qwen2.5-VL's language model lives under ``model.language_model.``
in memory and ``model.`` on disk. vLLM and SGLang load the Hub layout, so a version must
hold the tensors ``save_pretrained`` would write, under those names: transformers' own
``revert_weight_conversion`` with the model's own conversions does exactly that (a split of
fused experts is a copy per expert; a rename is free). Models without conversions, and
transformers releases without the machinery, pass through unchanged.

A sharded trainer rank holds rows of each in-memory tensor, never the whole
(:mod:`engine_ext.trainer.shards`), so :func:`rows_in_checkpoint_layout` converts rows:
transformers' own conversion runs on the local rows, and is accepted only where it is known to
act row by row (an expert split along dimension 0, chunks along the others, renames); the
global names and shapes come from the same conversion run on a ``meta`` tensor of the full
shape, so nothing is gathered and every output is checked against what ``save_pretrained``
would write. Checked with transformers 5.19.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field

import torch

# Wrappers around a whole model (DDP, torch.compile, accelerate): the model is an attribute.
_WRAPPED = ("module", "_orig_mod")


def transformers_model(obj) -> torch.nn.Module | None:
    """The transformers ``PreTrainedModel`` ``obj`` is or wraps (DDP, ``torch.compile``), else None; FSDP2's
    ``fully_shard`` subclasses the model's class in place (``FSDPQwen3MoeForCausalLM``), hence the MRO."""
    for _ in range(4):
        if (
            any(c.__module__.startswith("transformers.") for c in type(obj).__mro__)
            and hasattr(obj, "config")
            and hasattr(obj, "state_dict")
        ):
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


@dataclass(frozen=True)
class Rows:
    """Rows ``[start, start + len(tensor))`` of the checkpoint tensor ``name`` of ``shape``."""

    name: str
    tensor: torch.Tensor
    shape: tuple
    start: int


@dataclass
class _Conversions:
    """What ``save_pretrained`` reverts for one model, as ``revert_weight_conversion`` finds it
    (transformers 5.19), and the checkpoint tensors each whole in-memory tensor becomes."""

    renamings: list
    converters: list
    by_pattern: dict  # source pattern -> its converter
    whole: dict = field(default_factory=dict)  # (name, shape, dtype) -> {checkpoint name: shape}


# model -> its _Conversions (None: it has none). Weak: a freed model frees its entry. Looking them up
# for each tensor at each publish took 0.25 s of a 531-tensor MoE's training step.
_CONVERSIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _conversions(model: torch.nn.Module | None) -> _Conversions | None:
    if model is None:
        return None
    if model not in _CONVERSIONS:
        _CONVERSIONS[model] = _reversed_conversions(model)
    return _CONVERSIONS[model]


def _reversed_conversions(model: torch.nn.Module) -> _Conversions | None:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming
    except ImportError:  # transformers 4: no conversions
        return None
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [
            c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)
        ]
    if not conversions:
        return None
    reverse = [c.reverse_transform() for c in conversions[::-1]]
    converters = [c for c in reverse if isinstance(c, WeightConverter)]
    return _Conversions(
        [c for c in reverse if isinstance(c, WeightRenaming)],
        converters,
        {k: c for c in converters for k in c.source_patterns},
    )


def _whole(model: torch.nn.Module, conv: _Conversions, name: str, shape: tuple, dtype: torch.dtype) -> dict:
    """{checkpoint name: shape} the whole in-memory tensor ``name`` converts to (from a ``meta`` tensor: no bytes)."""
    key = (name, tuple(shape), dtype)
    if key not in conv.whole:
        from transformers.core_model_loading import revert_weight_conversion

        out = revert_weight_conversion(model, {name: torch.empty(shape, dtype=dtype, device="meta")})
        conv.whole[key] = {k: tuple(t.shape) for k, t in out.items()}
    return conv.whole[key]


def _row_local(ops) -> bool | None:
    """Whether a converter's reverse operations act row by row on dimension 0: True when they
    split it into one tensor per row (the experts), False when they keep it (chunks along the
    other dimensions), None when they mix rows (anything else)."""
    from transformers.core_model_loading import Chunk, SplitModulelist

    split = False
    for op in ops:
        if isinstance(op, SplitModulelist) and op.dim == 0 and not split:
            split = True
        elif not (isinstance(op, Chunk) and (split or op.dim != 0)):
            return None
    return split


def rows_in_checkpoint_layout(
    model: torch.nn.Module | None, name: str, local: torch.Tensor, shape: tuple, start: int
) -> list[Rows]:
    """What rows ``[start, start + len(local))`` of the in-memory tensor ``name`` (of ``shape``) are
    in the checkpoint layout: one :class:`Rows` per checkpoint tensor they hold a part of (the
    same rows, renamed; rows of each chunk; or whole per-row tensors: one expert each).
    Raises NotImplementedError for a conversion that mixes rows (it would need the whole tensor)."""
    conv = _conversions(model)
    if conv is None:
        return [Rows(name, local, tuple(shape), start)]
    from transformers.core_model_loading import rename_source_key, revert_weight_conversion

    renamed, pattern = rename_source_key(name, conv.renamings, conv.converters, reverse=True)
    if pattern is None:
        return [Rows(renamed, local, tuple(shape), start)]
    split = _row_local(conv.by_pattern[pattern].operations)
    if split is None:
        raise NotImplementedError(
            f"{name}: its checkpoint layout comes from {conv.by_pattern[pattern].operations}, which mixes rows; a sharded "
            "publisher converts row by row only (experts split along dim 0, chunks along other dims). Publish "
            "gathered weights with DeltaPublisher, or pass a state dict already in the checkpoint layout"
        )
    full = _whole(model, conv, name, shape, local.dtype)
    if split:  # one checkpoint tensor per row: the rank's row j is the whole tensor's row start + j
        rows = []
        for k, t in (revert_weight_conversion(model, {name: local}) if len(local) else {}).items():
            g = _global_row(k, start, full)
            if tuple(t.shape) != full[g]:
                raise ValueError(f"{g}: the rank's rows convert to {tuple(t.shape)}, the whole tensor to {full[g]}")
            rows.append(Rows(g, t, tuple(t.shape), 0))
        return rows
    out = (
        revert_weight_conversion(model, {name: local})
        if len(local)
        else {k: torch.empty((0, *s[1:]), dtype=local.dtype) for k, s in full.items()}
    )
    if set(out) != set(full) or any(tuple(out[k].shape[1:]) != full[k][1:] or len(out[k]) != len(local) for k in out):
        raise ValueError(
            f"{name}: rows {start}..{start + len(local)} convert to {sorted(out)}, not rows of {sorted(full)}"
        )
    return [Rows(k, t, full[k], start) for k, t in out.items()]


def _global_row(local_name: str, start: int, full: dict) -> str:
    """The checkpoint name of a rank's row ``j`` (``local_name``: numbered ``j`` by the conversion of
    the rank's rows) among the whole tensor's (``full``): the one number of the name that, moved
    by ``start``, names a tensor of ``full``."""
    if start == 0:
        hits = {local_name} & set(full)
    else:
        parts = re.split(r"(\d+)", local_name)
        hits = {
            "".join(parts[:i] + [str(int(parts[i]) + start)] + parts[i + 1 :]) for i in range(1, len(parts), 2)
        } & set(full)
    if len(hits) != 1:
        raise ValueError(
            f"{local_name}: moved by {start} rows it names {len(hits)} tensors of the checkpoint layout: "
            f"{sorted(hits)[:4]}"
        )
    return hits.pop()


def checkpoint_names(model: torch.nn.Module | None, name: str, shape: tuple, dtype: torch.dtype) -> list[str]:
    """The checkpoint tensors the whole in-memory tensor ``name`` becomes (itself, without conversions)."""
    conv = _conversions(model)
    return [name] if conv is None else list(_whole(model, conv, name, shape, dtype))


__all__ = ["Rows", "checkpoint_names", "rows_in_checkpoint_layout", "to_checkpoint_layout", "transformers_model"]
