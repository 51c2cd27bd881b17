"""What a trainer hands a publisher, as the checkpoint the engines load: one flat
``{name: tensor}``, the names a wrapper adds (``torch.compile``, DDP, FSDP1, activation
checkpointing) taken off, and each storage once (tied embeddings are one tensor under two names:
the engines load one of them). Used by :class:`~engine_ext.trainer.publisher.DeltaPublisher` on
every version and by :func:`~engine_ext.trainer.shards.held_tensors` on a sharded trainer's rank."""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

# Wrappers around the whole model (torch.compile, DDP): a prefix on every name.
WHOLE_MODEL_PREFIXES = ("_orig_mod.", "module.")
# Wrappers FSDP1 and activation checkpointing put around submodules: a whole name component.
WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def _alias_key(t: torch.Tensor):
    """What makes two tensors one: the same elements of one storage, seen the same way
    (device, address of the first element, dtype, shape, strides); None for a tensor that
    aliases nothing it could be confused with (empty, meta, another tensor subclass). An FSDP2
    ``DTensor`` is keyed by its local shard and placements."""
    if hasattr(t, "to_local") and hasattr(t, "placements"):
        local = _alias_key(t.to_local())
        return None if local is None else (local, tuple(t.placements), tuple(t.shape))
    if t.numel() == 0 or t.device.type == "meta" or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return None
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def _without_wrapper_components(name: str) -> str:
    """``name`` without the components submodule wrappers add (whole components only)."""
    return ".".join(c for c in name.split(".") if c not in WRAPPER_COMPONENTS)


def _common_prefix(names: list[str]) -> str | None:
    """The whole-model wrapper prefix every one of ``names`` starts with, if any."""
    for prefix in WHOLE_MODEL_PREFIXES:
        if all(n.startswith(prefix) for n in names):
            return prefix
    return None


def _checkpoint_names(names: list[str]) -> tuple[list[str], list[str]]:
    """(names without wrapper prefixes and components, the whole-model prefixes stripped in order).

    A prefix is stripped only where every name has it, and again for a wrapper inside a wrapper
    (``_orig_mod.module.``)."""
    stripped = []
    while names:
        prefix = _common_prefix(names)
        if prefix is None:
            break
        names = [n[len(prefix) :] for n in names]
        stripped.append(prefix)
    return [_without_wrapper_components(n) for n in names], stripped


def clean_state_dict(model_or_sd, aliases: dict[str, str] | None = None, cast=None) -> dict[str, torch.Tensor]:
    """A flat {checkpoint name: tensor} from an nn.Module, a state dict, or an iterable of
    ``(name, tensor)`` (TRL's parameter iterator), wrapper names removed, each storage once.

    A whole-model wrapper's prefix is stripped only where every name starts with it
    (repeated for nested wrappers), and submodule wrappers only as whole dot-separated
    components, so names that merely contain ``module`` or ``_orig_mod``
    (``vision_module.weight``) are left alone.

    Names that alias one storage (tied embeddings: ``state_dict()`` holds
    ``model.embed_tokens.weight`` and ``lm_head.weight``, one tensor under two names) are
    one tensor: the first in state dict / registration order is kept, which is the name
    ``named_parameters()`` and ``save_pretrained`` keep and the one vLLM and SGLang load
    (their loaders skip the tied copy). The names dropped go into ``aliases`` ({dropped:
    kept}). Tensors that only share a storage (views at other offsets or strides) stay.
    ``cast`` (e.g. to the served dtype) is applied to each kept tensor as it is taken, after
    aliases are found on the tensors as given (a cast copy aliases nothing), so an iterator
    of gathered fp32 tensors is never held whole in fp32. Only a tensor still alive is an alias
    (weak references: a gathered tensor freed once cast gives its address to the next one).
    Ties between gathered tensors cannot be seen here (:mod:`engine_ext.integrations.verl`).
    """
    if isinstance(model_or_sd, torch.nn.Module):
        items = model_or_sd.state_dict().items()
    elif isinstance(model_or_sd, Mapping):
        items = model_or_sd.items()
    else:
        items = model_or_sd  # an iterable of (name, tensor), walked once
    names: list[str] = []  # the names kept, as given
    tensors: list[torch.Tensor] = []
    keys: list = []  # each kept tensor's alias key (None: aliases nothing)
    first: dict = {}  # alias key -> (the name kept for it, a weak reference to its tensor)
    dropped: dict[str, str] = {}  # a name dropped as an alias -> the name kept, both as given
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            continue
        key = _alias_key(t)
        if key is not None and key in first and first[key][1]() is not None:  # alive: its address is its own
            dropped[name] = first[key][0]
            continue
        if key is not None:
            first[key] = (name, weakref.ref(t))
        names.append(name)
        keys.append(key)
        tensors.append(t.detach() if cast is None else cast(t))
    clean, prefixes = _checkpoint_names(names)
    out: dict[str, torch.Tensor] = {}
    key_of: dict[str, object] = {}
    for name, key, t in zip(clean, keys, tensors):
        if name in out and (key is None or key != key_of[name]):
            raise ValueError(f"two tensors map to the checkpoint name {name!r}")
        out[name] = t
        key_of[name] = key
    if aliases is not None and dropped:
        rename = dict(zip(names, clean))
        for dropped_name, kept_name in dropped.items():
            for prefix in prefixes:
                dropped_name = dropped_name.removeprefix(prefix)
            aliases[_without_wrapper_components(dropped_name)] = rename[kept_name]
    return out
