"""Worker-side glue: one :class:`~engine_ext.server.rank.RankUpdater` per vLLM worker.

The general plugin adds one method, ``engine_ext(op, **kwargs)``, to vLLM's worker base
class in every process, so the engine client's ordinary
``collective_rpc("engine_ext", args=(op,), kwargs=...)`` reaches it by name (no pickled
functions, no ``--worker-extension-cls``). It answers :func:`engine_ext.server.rank.run_op`'s
wire data and never raises.
"""

from __future__ import annotations

import logging

import torch

from ...errors import UnsupportedError
from ...server.rank import RankUpdater, run_op
from ...store.checkpoint import served_checkpoint
from . import compat

log = logging.getLogger("engine_ext")
RPC_METHOD = "engine_ext"


def cpu_refresh(model: torch.nn.Module):
    """Refresh hook for vLLM's CPU backend: re-pack the linear layers whose weights changed and the
    causal-conv1d weights that changed, re-derive the AMX MLA impl's packed W_UK/W_UV of the layers whose
    ``kv_b_proj`` changed, and re-pack the touched experts of MoE layers."""
    from .patches import (
        conv_layers,
        mla_layers,
        moe_layers,
        packed_layers,
        rederive_mla,
        repack,
        repack_conv,
        repack_experts,
    )

    def refresh(touched) -> None:
        for layer in packed_layers(model):
            if touched is None or layer.weight.untyped_storage().data_ptr() in touched:
                repack(layer)
        for layer in conv_layers(model):
            if touched is None or layer._engine_ext_conv.untyped_storage().data_ptr() in touched:
                repack_conv(layer)
        for layer in mla_layers(model):
            if touched is None or layer.kv_b_proj.weight.untyped_storage().data_ptr() in touched:
                rederive_mla(layer)
        for layer in moe_layers(model):
            repack_experts(layer, touched)

    return refresh


def cpu_derived_check(model: torch.nn.Module):
    """Audit hook for vLLM's CPU backend: every derived copy the kernels read (sgl-packed linear
    weights, packed causal-conv1d weights, MLA's W_UK/W_UV, packed MoE experts and padded expert biases) compared
    bit for bit with a fresh derivation from the weights the maps write. ``check()``: every layer, O(model)
    (an operator's ``?audit=1``); ``check(touched)``: the layers an apply wrote; ``sample=True``: of those,
    one layer of each kind, a different one at each call (the default check after every apply)."""
    from .patches import (
        conv_copy_stale,
        conv_layers,
        experts_copy_stale,
        linear_copy_stale,
        mla_attention_layers,
        mla_copy_stale,
        moe_layers,
        packed_layers,
    )

    turn = [0]

    def written(layer, weight, touched) -> bool:
        return touched is None or weight.untyped_storage().data_ptr() in touched

    def check(touched=None, sample: bool = False) -> dict:
        names = {id(m): n for n, m in model.named_modules()}
        kinds = [
            [(m, linear_copy_stale) for m in packed_layers(model) if written(m, m.weight, touched)],
            [(m, mla_copy_stale) for m in mla_attention_layers(model) if written(m, m.kv_b_proj.weight, touched)],
            [
                (m, experts_copy_stale)
                for m in moe_layers(model)
                if touched is None or any(written(m, getattr(m, n), touched) for n in ("w13_weight", "w2_weight"))
            ],
            [(m, conv_copy_stale) for m in conv_layers(model) if written(m, m._engine_ext_conv, touched)],
        ]
        if sample:
            turn[0] += 1
            kinds = [[layers[turn[0] % len(layers)]] for layers in kinds if layers]
            kinds = [
                [(m, _one_expert(f, turn[0]) if f is experts_copy_stale else f) for m, f in layers] for layers in kinds
            ]
        checked, opaque, stale = 0, 0, []
        for layer, is_stale in ((m, f(m)) for layers in kinds for m, f in layers):
            if is_stale is None:
                opaque += 1
                continue
            checked += 1
            if is_stale:
                stale.append(names.get(id(layer), type(layer).__name__))
        return {"checked": checked, "opaque": opaque, "stale": sorted(stale)}

    return check


def _one_expert(check, turn: int):
    """``check`` (experts_copy_stale) on one expert of a layer, a different one at each turn."""

    def one(layer):
        n = layer.w13_weight.shape[0]
        return check(layer, torch.tensor([turn % n]))

    return one


# Quantisation methods whose served weights are the checkpoint's bytes (or a copy the patches
# keep in step): everything else derives its served copy at load (fp8 VNNI prepack on the CPU,
# Marlin repacks...), which an in-place write would not reach.
IN_PLACE_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedFusedMoEMethod", "UnquantizedEmbeddingMethod"})


def derived_layers(model: torch.nn.Module) -> dict[str, str]:
    """``{layer name: quant method class}`` of the layers whose method is not in :data:`IN_PLACE_METHODS`."""
    return {
        name: type(m.quant_method).__name__
        for name, m in model.named_modules()
        if getattr(m, "quant_method", None) is not None and type(m.quant_method).__name__ not in IN_PLACE_METHODS
    }


def build_updater(model: torch.nn.Module, vllm_config, rank: int = 0) -> RankUpdater:
    """A RankUpdater over ``model`` using its own ``load_weights`` as the loader.

    On the CPU, refuses (every update then answers 503 with the reason; serving goes on) a
    model with quantised layers: vLLM's CPU fp8 methods VNNI-prepack the weights into new
    parameters at load, and no refresh for them is written (docs/MOE_FP8.md)."""
    if compat.is_cpu() and (derived := derived_layers(model)):
        methods = sorted(set(derived.values()))
        raise UnsupportedError(
            f"engine_ext cannot update {len(derived)} quantised layer(s) in place on vLLM CPU: "
            f"{methods} derive the served weights at load (e.g. {next(iter(derived))}); "
            "serve the bf16 checkpoint on the CPU, or a GPU (docs/MOE_FP8.md)"
        )
    mc = vllm_config.model_config
    ckpt = served_checkpoint(mc.model, getattr(mc, "revision", None))

    def load(name: str, tensor: torch.Tensor) -> None:
        model.load_weights([(name, tensor)])

    def find_unreproducible(maps: dict) -> dict[str, str]:
        from ...server.census import unreproducible
        from .census import claimed

        return unreproducible(model, maps, claimed)

    def compare_cold(checkpoint: str) -> dict:
        from .cold_audit import cold_audit

        return cold_audit(model, vllm_config, checkpoint)

    if compat.is_cpu():
        from .patches import cpu_paths

        refresh, describe = cpu_refresh(model), (lambda: {"platform": "cpu", **cpu_paths(model)})
        check_derived = cpu_derived_check(model)
    else:
        refresh, describe, check_derived = None, (lambda: {"platform": compat.device_type()}), None
    return RankUpdater(
        model,
        load,
        ckpt.specs(),
        ckpt.load,
        refresh,
        rank=rank,
        describe=describe,
        check_derived=check_derived,
        find_unreproducible=find_unreproducible,
        compare_cold=compare_cold,
    )


def updater_for(model: torch.nn.Module, vllm_config, rank: int = 0) -> RankUpdater:
    """The one RankUpdater of ``model`` (shared by the worker RPC and the ``delta`` backend).

    Kept in the model's ``__dict__`` (not a submodule or parameter): it lives and dies
    with the model, so a dropped model frees its maps and undo logs.
    """
    up = model.__dict__.get("_engine_ext_updater")
    if up is None:
        up = build_updater(model, vllm_config, rank)
        model.__dict__["_engine_ext_updater"] = up
    return up


def engine_ext(self, op: str, **kwargs) -> dict:
    """``collective_rpc("engine_ext", args=(op,), kwargs=...)`` entry on every worker."""

    def updater() -> RankUpdater:
        return updater_for(compat.worker_model(self), self.vllm_config, getattr(self, "rank", 0))

    with compat.current_config(self.vllm_config):
        return run_op(updater, op, kwargs, rank=getattr(self, "rank", 0))


# The names the general plugin registers the weight-transfer backend under: vLLM's convention (the
# trainer side registers the same name), and the old one.
BACKEND_NAMES = ("engine_ext", "delta")


def label_after_finish(llm, weight_version: str | None) -> None:
    """After ``LLM.finish_weight_update(weight_version)`` on an engine_ext backend: every rank records
    the label beside the version it serves (vLLM's workers get no argument in their finish)."""
    if weight_version is None or compat.weight_transfer_backend(compat.llm_vllm_config(llm)) not in BACKEND_NAMES:
        return
    from ...server.protocol import RankReply
    from ...server.transaction import check_replies

    check_replies(
        [
            RankReply.from_wire(w)
            for w in compat.llm_collective_rpc(llm, RPC_METHOD, args=("set_label",), kwargs={"label": weight_version})
        ]
    )


def install() -> None:
    """Add the ``engine_ext`` RPC method to vLLM's worker base class (idempotent)."""
    compat.install_worker_method(RPC_METHOD, engine_ext)
