"""What an engine's post-processing derived from the loaded weights, and whether every such copy is kept in step.

After the loader wrote the checkpoint into the model's parameters, the engine's post-processing
(vLLM's and SGLang's ``process_weights_after_loading``) lets every layer re-lay what its kernels read:
packing, padding, prepacked handles, derived tensors. An in-place update writes the checkpoint-layout
weights, so each copy made there must be refreshed by the engine adapter (vLLM's patches,
:mod:`engine_ext.engines.vllm.patches`), or the server computes with stale weights while its
fingerprint (read through the checkpoint layout) says all is well: silent divergence.

The census finds those copies without knowing the model: each engine plugin wraps its engine's
post-processing (:func:`take`) and records, for every module, the state reachable from it
(its parameters and buffers, tensors in its ``__dict__``, in the objects it holds, such as its
quant method, attention impl or MoE experts, and in the closures it holds, such as the CPU GEMM's
``cpu_linear``) before and after. What is new after (a tensor on a storage that did not exist
before, an opaque object such as a oneDNN handle, a parameter whose data was re-bound) was derived
by post-processing. Each one must be *claimed*: a copy the adapter refreshes after every write
(vLLM: :func:`engine_ext.engines.vllm.census.claimed`; SGLang claims nothing). An unclaimed copy in a module whose parameters, or its descendants', receive
checkpoint weights makes those checkpoint tensors *unreproducible*: updates writing them are
refused (409), and the start-up names them. A new copy in a module that holds no such parameter
cannot come from the weights an update writes (a workspace, a rotary cache) and is not counted.

This is a census of identities, not of bytes: it costs a walk over the modules' attributes (no
tensor data is read) once, at load. The bytes of the claimed copies are checked by the audit
(vLLM's ``?audit=1`` and ``ENGINE_EXT_VERIFY_DERIVED``: :func:`engine_ext.engines.vllm.worker.cpu_derived_check`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

log = logging.getLogger("engine_ext")
CENSUS_ATTR = "_engine_ext_census"
_MAX_DEPTH = 4  # module -> quant method -> experts -> their dict: deep enough for vLLM 0.32's holders
_SKIP_TYPES = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, type)


def _is_config(obj) -> bool:
    name = type(obj).__name__
    return name.endswith(("Config", "Configs")) or name in ("ProcessGroup", "GroupCoordinator", "Logger")


def _walk(obj, path: str, out: dict, depth: int, seen: set) -> None:
    """``out[path] = key`` for every tensor (its storage) and opaque object reachable from ``obj``."""
    if isinstance(obj, _SKIP_TYPES) or isinstance(obj, torch.nn.Module) or id(obj) in seen or depth > _MAX_DEPTH:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "meta" and obj.untyped_storage().nbytes() > 0:
            out[path] = ("tensor", obj.device.type, obj.untyped_storage().data_ptr())
        return
    if isinstance(obj, dict):
        for k, v in list(obj.items())[:256]:
            _walk(v, f"{path}[{k!r}]", out, depth + 1, seen)
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(list(obj)[:256]):
            _walk(v, f"{path}[{i}]", out, depth + 1, seen)
        return
    if callable(obj) and getattr(obj, "__closure__", None):
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__):
            try:
                _walk(cell.cell_contents, f"{path}.<{name}>", out, depth + 1, seen)
            except ValueError:  # an empty cell
                pass
        return
    if callable(obj) or _is_config(obj):
        return
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        if type(obj).__module__.startswith(("vllm", "torch", "engine_ext")) or not attrs:
            for k, v in list(attrs.items()):
                _walk(v, f"{path}.{k}", out, depth + 1, seen)
        return
    out[path] = ("opaque", type(obj).__name__, id(obj))  # a C++ handle (oneDNN's) or another object we cannot read


def module_state(module: torch.nn.Module) -> dict[str, tuple]:
    """The tensors (by storage) and opaque objects ``module`` itself holds (not its child modules')."""
    out: dict[str, tuple] = {}
    seen: set = set()
    for k, v in vars(module).items():
        if k == "_modules":
            continue
        if k in ("_parameters", "_buffers"):
            for n, t in v.items():
                if t is not None:
                    _walk(t, n, out, 0, seen)
        else:
            _walk(v, k, out, 0, seen)
    return out


@dataclass
class Census:
    """{module name: {path: key}} of what post-processing made, and whether it ran at all."""

    derived: dict[str, dict[str, tuple]] = field(default_factory=dict)
    modules: int = 0


def take(model: torch.nn.Module, process) -> None:
    """Run vLLM's post-processing (``process()``) on ``model`` and record what it derived (:class:`Census`)."""
    before = {name: module_state(m) for name, m in model.named_modules()}
    storages = {key for state in before.values() for key in state.values() if key[0] == "tensor"}
    process()
    census = Census(modules=len(before))
    for name, m in model.named_modules():
        made = {}
        for path, key in module_state(m).items():
            if key[0] == "tensor" and key in storages:
                continue  # a storage that existed before: the loaded weights themselves, or a view of them
            if key[0] == "opaque" and before.get(name, {}).get(path) == key:
                continue  # held before post-processing
            made[path] = key
        if made:
            census.derived[name] = made
    model.__dict__[CENSUS_ATTR] = census


Claims = Callable[[torch.nn.Module], "set[tuple]"]  # the keys of the copies an engine adapter refreshes in a module


def keys_of(obj) -> set[tuple]:
    """The keys (:func:`module_state`'s) of the tensors and opaque objects reachable from ``obj``: what a claim names."""
    out: dict = {}
    _walk(obj, "claim", out, 0, set())
    return set(out.values())


def unclaimed(model: torch.nn.Module, maps: dict, claimed: Claims | None = None) -> dict[str, list[str]] | None:
    """{module name: [paths of derived copies no refresh keeps in step]}; None where no census was taken
    (the model was not post-processed through the engine's loader in this process). A copy is claimed by
    the engine adapter (``claimed(module)``, wherever it is reachable from: the MoE kernel's own holder
    too) or is itself where the maps write (a bias vLLM's CPU GEMM keeps in float32: a converting map,
    checked at start-up through the fingerprints like every mapped weight)."""
    from .maps import TensorMap

    census = model.__dict__.get(CENSUS_ATTR)
    if census is None:
        return None
    keys: set[tuple] = set()
    for mod in model.modules() if claimed is not None else ():
        keys |= claimed(mod)
    for m in maps.values():
        if isinstance(m, TensorMap):
            keys |= {("tensor", pc.dest.device.type, pc.dest.untyped_storage().data_ptr()) for pc in m.pieces}
    out = {}
    for name, made in census.derived.items():
        rest = sorted(p for p, k in made.items() if k not in keys)
        if rest:
            out[name] = rest
    return out


def unreproducible(model: torch.nn.Module, maps: dict, claimed: Claims | None = None) -> dict[str, str]:
    """{checkpoint tensor: why} for the tensors whose weights land in a module (or a descendant of a
    module) holding a derived copy that no patch refreshes: an in-place write would not reach what the
    kernels read. Unmappable tensors (reloaded through the loader) count by the parameter their loader wrote."""
    from .maps import TensorMap

    free = unclaimed(model, maps, claimed)
    if not free:
        if free is None:
            log.warning("engine_ext: no post-processing census was taken for this model (not loaded through the "
                        "engine's loader here?): derived copies are not checked at start-up")
        return {}
    owner = {}  # parameter storage -> the modules holding it or an ancestor of its holder
    for name, mod in model.named_modules():
        for p in mod.parameters(recurse=True):
            if p.untyped_storage().nbytes() > 0:
                owner.setdefault(p.untyped_storage().data_ptr(), set()).add(name)
    out = {}
    for tensor, m in maps.items():
        ptrs = {pc.dest.untyped_storage().data_ptr() for pc in m.pieces} if isinstance(m, TensorMap) else set(m.storages)
        holders = set().union(*(owner.get(ptr, set()) for ptr in ptrs)) if ptrs else set()
        hit = sorted(holders & set(free))
        if hit:
            out[tensor] = f"{hit[0]} holds {free[hit[0]][0]!r}, derived after loading and kept in step by nothing"
    return out


__all__ = ["Census", "Claims", "take", "keys_of", "unclaimed", "unreproducible", "module_state"]
