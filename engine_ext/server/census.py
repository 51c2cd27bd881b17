"""What an engine's post-processing derived from the loaded weights, and whether every such copy is kept in step.

After the loader wrote the checkpoint into the model's parameters, the engine's post-processing
(vLLM's and SGLang's ``process_weights_after_loading``) lets every layer re-lay what its kernels read:
packing, padding, prepacked handles, derived tensors. An in-place update writes the checkpoint-layout
weights, so each copy made there must be refreshed by the engine adapter (vLLM's patches,
:mod:`engine_ext.engines.vllm.patches`), or the server computes with stale weights while its
fingerprint (read through the checkpoint layout) says all is well: silent divergence.

The census finds those copies without knowing the model, and tells a copy of the weights from state
that merely appeared at the same time (a KV-cache scale, a workspace, a rotary cache): each engine plugin
wraps its engine's post-processing (:func:`take`), which then runs under a *provenance tracker*:

* every parameter and buffer storage is a *source* before post-processing runs;
* every torch operation (``TorchDispatchMode``: aten ops and the engines' custom ops) and every Triton
  launch gives what it writes the union of the sources of what it reads; a view shares its storage,
  so it shares its sources;
* bytes that leave torch (``item()``, ``tolist()``, ``numpy()``, ``data_ptr()``, a custom op returning a
  handle rather than a tensor) are an *escape*: everything the module whose post-processing step it was
  (its quant method's or its own ``process_weights_after_loading``) holds anew afterwards counts as
  computed from those sources too, since the tracker cannot follow Python values;
* a parameter whose storage post-processing re-bound or dropped is *re-laid*: its old storage, where the
  loader wrote, is still a source, and a module that still reads it (Granite 4's mamba mixer keeps a
  view of its conv1d weight as ``conv_weights``) holds a copy nothing writes any more.

After post-processing the census walks the state each module holds (its parameters and buffers, tensors
in its ``__dict__``, in the objects it holds, such as its quant method, attention impl or MoE experts,
and in the closures it holds, such as the CPU GEMM's ``cpu_linear``), and records every tensor whose bytes
post-processing computed or re-laid and every object it made, with its sources (:class:`Item`).

:func:`unreproducible` then joins the census with the maps (where updates write): an item that is not
itself where the maps write and that no adapter claims (a copy the adapter refreshes after every write;
vLLM: :func:`engine_ext.engines.vllm.census.claimed`; SGLang claims nothing) makes exactly the
checkpoint tensors it was computed from *unreproducible*: updates writing them are refused (409), and
the start-up names them. State computed from no checkpoint tensor refuses nothing. An object the
tracker cannot see into (a C++ handle) that post-processing made in a module holding checkpoint weights
counts as computed from them (it cannot be shown otherwise).

Cost: one walk over the modules' attributes before and after (no tensor data is read), and the
tracker's bookkeeping per torch operation of post-processing (about 13 µs each on the project's host,
``python bench/census_cost.py --ops``; the model's bytes are not read again; docs/GPU.md has the rest). The bytes of the claimed copies are checked by the audit (vLLM's
``?audit=1`` and ``ENGINE_EXT_VERIFY_DERIVED``: :func:`engine_ext.engines.vllm.worker.cpu_derived_check`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger("engine_ext")
CENSUS_ATTR = "_engine_ext_census"
_MAX_DEPTH = 4  # module -> quant method -> experts -> their dict: deep enough for vLLM 0.32's holders
_SKIP_TYPES = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, type)
_SCALARS = (int, float, bool)
# Objects of these packages hold no model state (locks, executors, sockets, loggers): not walked into
_NOT_HOLDERS = {
    "logging",
    "threading",
    "concurrent",
    "asyncio",
    "multiprocessing",
    "socket",
    "ssl",
    "queue",
    "zmq",
    "ray",
    "weakref",
    "_thread",
    "subprocess",
    "selectors",
    "tokenizers",
    "transformers",
}

Key = tuple  # ("tensor", device type, storage data_ptr) | ("opaque", type name, id) | ("value", path, value)
_NOT_STATE = ("_engine_ext_updater", CENSUS_ATTR)  # our own bookkeeping on the model, made after post-processing
Sources = (
    frozenset  # of source tokens: one per storage of a loaded weight (a parameter or buffer before post-processing)
)


def _is_config(obj) -> bool:
    name = type(obj).__name__
    return name.endswith(("Config", "Configs")) or name in ("ProcessGroup", "GroupCoordinator", "Logger")


def _storage_ptr(t: torch.Tensor) -> int | None:
    """The data_ptr of ``t``'s storage; None for a tensor with no bytes here (meta, empty, a subclass without one)."""
    try:
        if t.device.type == "meta":
            return None
        st = t.untyped_storage()
        return st.data_ptr() if st.nbytes() > 0 else None
    except (RuntimeError, NotImplementedError):
        return None


def _walk(obj, path: str, out: dict, depth: int, seen: set, tensors: dict | None = None) -> None:
    """``out[path] = key`` for every tensor (its storage) and object reachable from ``obj`` (and, where
    ``tensors`` is given, ``tensors[path]`` = the tensor itself: the cold-load audit compares their bytes)."""
    if isinstance(obj, (_SKIP_TYPES, torch.nn.Module)) or id(obj) in seen or depth > _MAX_DEPTH:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        ptr = _storage_ptr(obj)
        if ptr is not None:
            out[path] = ("tensor", obj.device.type, ptr)
            if tensors is not None:
                tensors[path] = obj
        return
    if isinstance(obj, dict):
        for k, v in list(obj.items())[:256]:
            _walk(v, f"{path}[{k!r}]", out, depth + 1, seen, tensors)
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(list(obj)[:256]):
            _walk(v, f"{path}[{i}]", out, depth + 1, seen, tensors)
        return
    if callable(obj) and getattr(obj, "__closure__", None):
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__):
            try:
                _walk(cell.cell_contents, f"{path}.<{name}>", out, depth + 1, seen, tensors)
            except ValueError:  # an empty cell
                pass
        return
    if callable(obj) or _is_config(obj) or type(obj).__module__.split(".")[0] in _NOT_HOLDERS:
        return
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        slots = [s for cls in type(obj).__mro__ for s in getattr(cls, "__slots__", ()) if isinstance(s, str)]
        attrs = {s: getattr(obj, s) for s in slots if s != "__weakref__" and hasattr(obj, s)} if slots else None
    if isinstance(attrs, dict):  # any holder, the engines' and third parties' (triton_kernels' dataclasses) alike
        for k, v in list(attrs.items())[:256]:
            _walk(v, f"{path}.{k}", out, depth + 1, seen, tensors)
        return
    out[path] = ("opaque", type(obj).__name__, id(obj))  # a C++ handle (oneDNN's) or another object we cannot read


def module_state(module: torch.nn.Module, tensors: dict | None = None) -> dict[str, Key]:
    """The tensors (by storage), objects and scalar attributes ``module`` itself holds (not its child modules');
    ``tensors``: also filled with {path: tensor}."""
    out: dict[str, Key] = {}
    seen: set = set()
    for k, v in vars(module).items():
        if k == "_modules" or k in _NOT_STATE:
            continue
        if k in ("_parameters", "_buffers"):
            for n, t in v.items():
                if t is not None:
                    _walk(t, n, out, 0, seen, tensors)
        elif isinstance(v, _SCALARS):
            if not k.startswith("_engine_ext_"):  # (our patches' marks are not the engine's state)
                out[k] = ("value", k, v)  # a scale kept as a Python number (vLLM's ``_k_scale_float``)
        else:
            _walk(v, k, out, 0, seen, tensors)
    return out


def _direct_storages(module: torch.nn.Module) -> dict[str, int]:
    """{parameter or buffer name: storage data_ptr} of what ``module`` itself holds."""
    out = {}
    for n, t in [*module._parameters.items(), *module._buffers.items()]:
        ptr = None if t is None else _storage_ptr(t)
        if ptr is not None:
            out[n] = ptr
    return out


# ---------------------------------------------------------------------------- the provenance tracker

# Ops that read only their inputs' metadata (shape, dtype, device): what they make holds no weight bytes.
_METADATA_ONLY = {
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "new_empty",
    "new_zeros",
    "new_ones",
    "new_full",
    "new_empty_strided",
    "empty_strided",
    "empty",
    "zeros",
    "ones",
    "full",
    "arange",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "size",
    "stride",
    "dim",
    "is_same_size",
}
# Tensor methods through which bytes leave torch (TorchFunctionMode sees them; the dispatcher does not)
# (``data_ptr()`` is not one: vLLM and our patches use addresses as identities, and the engines' kernels read
# weights through ops the dispatcher sees)
_ESCAPES = {"numpy", "tolist", "__array__", "__dlpack__"}


class Provenance:
    """Which loaded weights each storage's bytes were computed from, while post-processing runs.

    Each source storage gets a token (not its address: a storage post-processing frees gives its address to
    the next allocation, a new parameter's perhaps). ``sources(t)``: the tokens of the weights ``t``'s bytes
    were computed from; ``escapes``: (scope module, tokens) of bytes that left torch in a module's
    post-processing step. Storages are followed by weak reference: a freed temporary's address, taken again
    by a later allocation, does not pass its sources on."""

    def __init__(self, weights: dict[int, torch.Tensor]):
        self._of: dict[int, tuple[StorageWeakRef, Sources]] = {}
        self.token_of: dict[int, int] = {}  # source storage's address (before) -> its token
        self.refs: list[StorageWeakRef] = []  # token -> its storage
        self.addresses: list[int] = []  # token -> its address (valid while the storage lives)
        for ptr, t in weights.items():
            ref = StorageWeakRef(t.untyped_storage())
            self.token_of[ptr] = len(self.refs)
            self._of[ptr] = (ref, frozenset({len(self.refs)}))
            self.refs.append(ref)
            self.addresses.append(ptr)
        self.escapes: list[tuple[str | None, Sources]] = []
        self._scope: list[str | None] = []

    def alive(self, token: int) -> bool:
        return not self.refs[token].expired()

    def own(self, ptr: int) -> int | None:
        """The token of the source storage at ``ptr``, where that storage still lives (else another holds the address)."""
        token = self.token_of.get(ptr)
        return token if token is not None and self.alive(token) else None

    def sources(self, t: torch.Tensor) -> Sources:
        ptr = _storage_ptr(t)
        return frozenset() if ptr is None else self.sources_of(ptr)

    def sources_of(self, ptr: int) -> Sources:
        entry = self._of.get(ptr)
        return frozenset() if entry is None or entry[0].expired() else entry[1]

    def add(self, t: torch.Tensor, srcs: Sources) -> None:
        ptr = _storage_ptr(t)
        if ptr is None or not srcs:
            return
        self._of[ptr] = (StorageWeakRef(t.untyped_storage()), srcs | self.sources(t))

    def escape(self, srcs: Sources) -> None:
        if srcs:
            self.escapes.append((self._scope[-1] if self._scope else None, srcs))

    @contextlib.contextmanager
    def scope(self, module_name: str | None) -> Iterator[None]:
        """Escapes inside belong to ``module_name``'s post-processing step (the innermost step wins)."""
        self._scope.append(module_name if module_name is not None or not self._scope else self._scope[-1])
        try:
            yield
        finally:
            self._scope.pop()

    def ops(self, args, kwargs) -> Sources:
        return frozenset().union(*(self.sources(t) for t in _tensors_in(args, kwargs)))


def _tensors_in(args, kwargs=None) -> list[torch.Tensor]:
    """The tensors among an op's arguments (aten takes tensors, and lists or tuples of them)."""
    out = []
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


class _TrackOps(TorchDispatchMode):
    """Every aten or custom op: what it writes (outputs and mutated arguments) takes the sources of what it reads."""

    def __init__(self, prov: Provenance):
        super().__init__()
        self.prov = prov
        self.ops = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Not wrapped in ``torch._disable_dynamo`` (torch 2.13 wraps every mode's ``__torch_dispatch__`` so): the
        wrapper swaps CPython's frame evaluator twice per op, which made every op of post-processing cost about
        0.75 ms (15 µs without it; ``python bench/census_cost.py --ops``). The handler is plain bookkeeping that
        Dynamo has no reason to trace, and a ``torch.compile``d function post-processing calls under the tracker
        still runs (DeepGEMM's ``per_block_cast_to_fp8``: ``tests/test_gpu_paths.py``)."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        if func.__name__.split(".")[0] in _METADATA_ONLY:
            return out
        with torch._C.DisableTorchFunction():
            srcs = self.prov.ops(args, kwargs)
            if not srcs:
                return out
            written = _tensors_in(
                [
                    args[i] if i < len(args) else kwargs.get(arg.name)
                    for i, arg in enumerate(func._schema.arguments)
                    if arg.alias_info is not None and arg.alias_info.is_write
                ]
            )
            for leaf in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(leaf, torch.Tensor):
                    self.prov.add(leaf, srcs)
                elif isinstance(leaf, (list, tuple)):
                    for t in _tensors_in(leaf):
                        self.prov.add(t, srcs)
                elif leaf is not None:  # a number or handle computed from the weights: out of our sight
                    self.prov.escape(srcs)
            for t in written:
                self.prov.add(t, srcs)
        return out


class _TrackEscapes(TorchFunctionMode):
    """Tensor methods through which bytes leave torch (numpy arrays, lists, raw pointers)."""

    def __init__(self, prov: Provenance):
        super().__init__()
        self.prov = prov

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _ESCAPES and args and isinstance(args[0], torch.Tensor):
            with torch._C.DisableTorchFunction():
                self.prov.escape(self.prov.sources(args[0]))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _track_triton(prov: Provenance) -> Iterator[None]:
    """A Triton launch reads and writes its tensor arguments out of the dispatcher's sight: each argument that
    is not itself a loaded weight (an output made for it) takes the sources of all; a weight passed to a
    kernel is taken as read (a kernel rewriting a weight in place is the load check's to see). Only where
    Triton is already imported (post-processing that uses it has)."""
    jit = sys.modules.get("triton.runtime.jit")
    cls = getattr(jit, "JITFunction", None)
    if cls is None:
        yield
        return
    orig = cls.run

    def run(self, *args, **kwargs):
        with torch._C.DisableTorchFunction():
            tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
            srcs = frozenset().union(*(prov.sources(t) for t in tensors))
            for t in tensors:
                ptr = _storage_ptr(t)
                if ptr is not None and prov.own(ptr) is None:
                    prov.add(t, srcs)
        return orig(self, *args, **kwargs)

    cls.run = run
    try:
        yield
    finally:
        cls.run = orig


@contextlib.contextmanager
def _scoped_steps(model: torch.nn.Module, prov: Provenance) -> Iterator[None]:
    """Mark each module's post-processing step (its quant method's ``process_weights_after_loading(layer)``,
    or its own), so that an escape belongs to the module whose step made it."""
    names = {id(m): n for n, m in model.named_modules()}
    patched = []
    for m in model.modules():
        for holder in (getattr(m, "quant_method", None), m):
            fn = getattr(holder, "process_weights_after_loading", None) if holder is not None else None
            if not callable(fn) or "process_weights_after_loading" in getattr(holder, "__dict__", {"": 0}):
                continue

            def step(*args, _fn=fn, _holder=holder, **kwargs):
                layer = (
                    _holder
                    if isinstance(_holder, torch.nn.Module)
                    else next((a for a in args if isinstance(a, torch.nn.Module)), None)
                )
                with prov.scope(names.get(id(layer))):
                    return _fn(*args, **kwargs)

            try:
                holder.__dict__["process_weights_after_loading"] = step
            except (AttributeError, TypeError):
                continue
            patched.append(holder)
    try:
        yield
    finally:
        for holder in patched:
            holder.__dict__.pop("process_weights_after_loading", None)


# ---------------------------------------------------------------------------- the census


@dataclass(frozen=True)
class Item:
    """A tensor or object a module holds after post-processing whose bytes post-processing computed,
    re-laid or made anew, with the weights it came from (storage data_ptrs before post-processing)."""

    path: str
    key: Key
    sources: Sources


@dataclass
class Census:
    """{module name: [Item]} of what post-processing made, and the weights' storages it re-laid."""

    items: dict[str, list[Item]] = field(default_factory=dict)
    relaid: dict[int, tuple[str, str]] = field(default_factory=dict)  # a re-bound or dropped parameter's old storage
    #                                                                   (its token) -> (its module, its name)
    addresses: dict[int, int] = field(default_factory=dict)  # token -> address, for the sources that still live
    modules: int = 0
    ops: int = 0  # torch ops post-processing ran (each followed by the tracker)
    seconds: float = 0.0  # post-processing under the tracker, and the walks
    process_seconds: float = 0.0  # of which post-processing itself (with the tracker's bookkeeping per op)

    @property
    def derived(self) -> dict[str, dict[str, Key]]:
        """{module name: {path: key}} of the items computed from the weights (what an update must keep in step)."""
        out: dict[str, dict[str, Key]] = {}
        for name, items in self.items.items():
            made = {it.path: it.key for it in items if it.sources}
            if made:
                out[name] = made
        return out


def take(model: torch.nn.Module, process: Callable[[], object]) -> None:
    """Run the engine's post-processing (``process()``) on ``model`` under the provenance tracker and
    record what it derived from the loaded weights (:class:`Census`, kept on the model)."""
    t0 = time.perf_counter()
    modules = dict(model.named_modules())
    before = {name: module_state(m) for name, m in modules.items()}
    held = {name: _direct_storages(m) for name, m in modules.items()}  # parameters and buffers, before
    weights: dict[int, torch.Tensor] = {}
    owner: dict[int, str] = {}
    for name, m in modules.items():
        for n, t in [*m._parameters.items(), *m._buffers.items()]:
            ptr = None if t is None else _storage_ptr(t)
            if ptr is not None:
                weights.setdefault(ptr, t)
                owner.setdefault(ptr, name)
    prov = Provenance(weights)
    owner_of = {prov.token_of[ptr]: name for ptr, name in owner.items()}
    old_keys = {key for state in before.values() for key in state.values()}
    ops = _TrackOps(prov)
    t1 = time.perf_counter()
    with _scoped_steps(model, prov), _track_triton(prov), _TrackEscapes(prov), ops:
        process()
    t2 = time.perf_counter()
    del weights
    modules = dict(model.named_modules())
    now = {name: _direct_storages(m) for name, m in modules.items()}
    still_held = {ptr for storages in now.values() for ptr in storages.values()}
    params_now = {_storage_ptr(p) for m in modules.values() for p in m._parameters.values() if p is not None}
    census = Census(
        modules=len(modules),
        ops=ops.ops,
        process_seconds=t2 - t1,
        addresses={tok: ptr for tok, ptr in enumerate(prov.addresses) if prov.alive(tok)},
    )
    for name, storages in held.items():
        params = modules[name]._parameters if name in modules else {}
        for n, ptr in storages.items():
            token = prov.token_of[ptr]
            if n not in params:
                continue
            if prov.alive(token) and (now.get(name, {}).get(n) == ptr or ptr in params_now):
                continue  # still this parameter, or another's (the same storage: it lives at that address)
            # the loader wrote here, and post-processing moved the parameter away (a buffer or an attribute that
            # still views this storage reads what the loader wrote at start-up, nothing since)
            census.relaid[token] = (name, n)
    escaped: dict[str, Sources] = {}
    for scope, srcs in prov.escapes:
        for name in [scope] if scope is not None else {owner_of[s] for s in srcs if s in owner_of}:
            escaped[name] = escaped.get(name, frozenset()) | srcs
    for name, m in modules.items():
        items = []
        for path, key in module_state(m).items():
            if key[0] == "value":
                new = before.get(name, {}).get(path) != key  # a number set or changed by post-processing
            else:
                new = key not in old_keys
            if key[0] == "tensor":
                ptr = key[2]
                srcs = prov.sources_of(ptr)
                own = prov.own(ptr)
                if own is not None and own in census.relaid:
                    srcs |= {own}
                elif ptr in still_held and not new and srcs <= {own}:
                    continue  # a parameter or buffer as loaded (or a view of one): the maps' business, not a copy
            elif not new:
                continue
            else:
                srcs = frozenset()
            if new and not srcs:  # made out of the tracker's sight: after an escape, from what escaped
                srcs = escaped.get(name, frozenset())
                if key[0] == "opaque":  # a handle the tracker cannot see into: made from what the module holds
                    srcs |= frozenset(prov.token_of[ptr] for ptr in held.get(name, {}).values())
            if srcs or new:
                items.append(Item(path, key, frozenset(srcs)))
        if items:
            census.items[name] = items
    census.seconds = time.perf_counter() - t0
    log.info(
        "engine_ext: post-processing census: %d modules, %d ops followed, %.3f s (post-processing %.3f s)",
        census.modules,
        census.ops,
        census.seconds,
        census.process_seconds,
    )
    model.__dict__[CENSUS_ATTR] = census


Claims = Callable[[torch.nn.Module], "set[tuple]"]  # the keys of the copies an engine adapter refreshes in a module


def keys_of(obj) -> set[Key]:
    """The keys (:func:`module_state`'s) of the tensors and objects reachable from ``obj``: what a claim names."""
    out: dict = {}
    _walk(obj, "claim", out, 0, set())
    return set(out.values())


def _destinations(maps: dict) -> tuple[dict[int, set[str]], dict[int, set[str]]]:
    """({storage data_ptr: checkpoint tensors the maps write there}, {storage data_ptr: unmappable checkpoint
    tensors whose loader writes there (the dense fallback reloads them through it)})."""
    from .maps import TensorMap

    mapped: dict[int, set[str]] = {}
    reloaded: dict[int, set[str]] = {}
    for name, m in maps.items():
        if isinstance(m, TensorMap):
            for pc in m.pieces:
                mapped.setdefault(pc.dest.untyped_storage().data_ptr(), set()).add(name)
        else:
            for ptr in getattr(m, "storages", ()):
                reloaded.setdefault(ptr, set()).add(name)
    return mapped, reloaded


def _stale(model: torch.nn.Module, maps: dict, claimed: Claims | None):
    """(module, item, checkpoint tensors) for every item no update or refresh keeps in step: a copy computed
    from checkpoint tensors (those), or a storage post-processing computed into which the dense fallback
    reloads checkpoint tensors (those: the loader writes the checkpoint's layout where post-processing had
    put another, a check through the maps cannot see it)."""
    census = model.__dict__.get(CENSUS_ATTR)
    if census is None:
        return None
    mapped, reloaded = _destinations(maps)
    keys: set[Key] = set()
    for mod in model.modules() if claimed is not None else ():
        keys |= claimed(mod)
    by_module = {name: set(_direct_storages(m).values()) for name, m in model.named_modules()}
    dests = {ptr: mapped.get(ptr, set()) | reloaded.get(ptr, set()) for ptr in {*mapped, *reloaded}}
    token_at = {at: tok for tok, at in census.addresses.items()}  # a living source storage's token by its address
    out = []
    for name, items in census.items.items():
        for it in items:
            if it.key in keys:
                continue  # refreshed by the adapter
            ptr = it.key[2] if it.key[0] == "tensor" else None
            own = token_at.get(ptr)
            if ptr in reloaded and it.sources - {own}:
                out.append((name, it, set(reloaded[ptr])))
                continue
            if ptr in mapped:
                # Written by the updates themselves, and checked through the maps at start-up, unless post-processing
                # computed it from other weights (DeepGEMM's UE8M0 requantisation of a weight and its scales from
                # each other): the load check sees that only where it changed a byte of the checkpoint loaded, and
                # an update would write what a cold start transforms. (A copy of its own old storage, a cast such as
                # the sgl path's float32 bias, is the maps' to follow.)
                others = {s for s in it.sources - {own} if census.relaid.get(s) != (name, it.path)}
                if others:
                    hit = set(mapped[ptr]) | {n for s in others for n in dests.get(census.addresses.get(s), ())}
                    out.append((name, it, hit))
                continue
            hit: set[str] = set()
            for src in it.sources:
                hit |= dests.get(census.addresses.get(src), set())
                if src in census.relaid:  # the loader's old storage: whatever the maps now write in that module
                    hit |= {n for at in by_module.get(census.relaid[src][0], ()) for n in dests.get(at, ())}
            if hit:
                out.append((name, it, hit))
    return out


def unclaimed(model: torch.nn.Module, maps: dict, claimed: Claims | None = None) -> dict[str, list[str]] | None:
    """{module name: [paths of copies of checkpoint weights that no refresh keeps in step]}; None where no
    census was taken (the model was not post-processed through the engine's loader in this process)."""
    stale = _stale(model, maps, claimed)
    if stale is None:
        return None
    out: dict[str, list[str]] = {}
    for name, it, _ in stale:
        out.setdefault(name, []).append(it.path)
    return {name: sorted(paths) for name, paths in sorted(out.items())}


def unreproducible(model: torch.nn.Module, maps: dict, claimed: Claims | None = None) -> dict[str, str]:
    """{checkpoint tensor: why} for the tensors that a copy no refresh keeps in step was computed from: an
    in-place write would not reach what the kernels read. Unmappable tensors (reloaded through the
    loader) count by the storages their loader wrote."""
    stale = _stale(model, maps, claimed)
    if stale is None:
        log.warning(
            "engine_ext: no post-processing census was taken for this model (not loaded through the "
            "engine's loader here?): derived copies are not checked at start-up"
        )
        return {}
    out: dict[str, str] = {}
    for name, it, hit in sorted(stale, key=lambda s: (s[0], s[1].path)):
        for tensor in sorted(hit):
            out.setdefault(
                tensor, f"{name} holds {it.path!r}, computed from it after loading and kept in step by nothing"
            )
    return out


__all__ = ["Census", "Claims", "Item", "Provenance", "keys_of", "module_state", "take", "unclaimed", "unreproducible"]
