"""The cold-load audit: the served model against a second instance built cold from a checkpoint.

Every other check reads the served weights through the maps the updates write through (the
fingerprint, the audit's ``differ``) or re-derives the copies the patches know of (``derived``), so a
wrong map, or a copy nobody knows of, cannot show there. This one does not use the maps: it builds a
second instance of the model with vLLM's own loader and post-processing (and our plugin's patches, as a
cold start has them) from a checkpoint directory, and compares every tensor each module holds, byte for
byte: parameters, buffers, and the tensors the census reaches in each module's attributes, held objects
(quant method, attention impl, MoE experts) and closures (the CPU GEMM's ``cpu_linear``). A GEMM that
serves through an opaque handle (oneDNN's) is compared by what it computes: both GEMMs on one probe
input.

It is the definitive check for tests and conformance sweeps (``GET /update_weights_delta?audit=1&cold=DIR``
with ``ENGINE_EXT_COLD_AUDIT=1``): it doubles the model's memory for the time of the call, so it is
off unless the operator turns it on. Tensors only one instance holds (state made by serving: KV caches
bound to the attention layers) are counted, not compared; a one-element int64 tensor is a handle's
address (oneDNN's), different in every instance, and is counted as a handle.
"""

from __future__ import annotations

import copy
import logging
import time

import torch

from ...format.dtypes import as_bits
from ...server.census import module_state
from . import compat

log = logging.getLogger("engine_ext")


def build_cold(vllm_config, checkpoint: str) -> torch.nn.Module:
    """A second instance of the served model, loaded by vLLM's loader from ``checkpoint`` (a directory of the
    same architecture and config) and post-processed as at start-up. The layers register themselves in a
    fresh forward context (a config copied shallowly), so the served model's stays as it is."""
    cfg = copy.copy(vllm_config)
    cfg.compilation_config = copy.copy(vllm_config.compilation_config)
    cfg.compilation_config.static_forward_context = {}
    for name in ("static_all_moe_layers",):
        if isinstance(getattr(cfg.compilation_config, name, None), list):
            setattr(cfg.compilation_config, name, [])
    mc = copy.copy(vllm_config.model_config)
    mc.model = checkpoint
    cfg.model_config = mc
    loader = compat.model_loader(cfg.load_config)
    with compat.current_config(cfg):
        return loader.load_model(vllm_config=cfg, model_config=mc)


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{path: tensor} of what ``module`` itself holds, by the census's walk (its bounds and its paths)."""
    found: dict[str, torch.Tensor] = {}
    module_state(module, tensors=found)
    return {path: t for path, t in found.items() if t.numel() > 0}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bits(a.detach()), as_bits(b.detach()))


def _is_handle(t: torch.Tensor) -> bool:
    return t.dtype == torch.int64 and t.numel() == 1


def _gemm_differs(live: torch.nn.Module, cold: torch.nn.Module) -> bool | None:
    """Whether two layers' CPU GEMMs compute differently on one probe input (None: no such GEMM here)."""
    fl, fc = getattr(live, "cpu_linear", None), getattr(cold, "cpu_linear", None)
    w = getattr(live, "weight", None)
    if not (callable(fl) and callable(fc)) or not isinstance(w, torch.Tensor) or w.ndim != 2 or w.numel() == 0:
        return None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, w.shape[1], generator=g).to(w.dtype)
    return not _same(fl(x, live.weight, getattr(live, "bias", None)), fc(x, cold.weight, getattr(cold, "bias", None)))


def compare(live: torch.nn.Module, cold: torch.nn.Module, limit: int = 20) -> dict:
    """Every module's tensors of ``live`` against ``cold``'s, byte for byte; GEMM handles by what they compute."""
    cold_modules = dict(cold.named_modules())
    compared = handles = gemms = 0
    live_only: list[str] = []
    cold_only: list[str] = []
    differ: list[str] = []
    for name, mod in live.named_modules():
        other = cold_modules.get(name)
        if other is None:
            live_only.append(name)
            continue
        a, b = _tensors(mod), _tensors(other)
        for path in sorted(set(a) | set(b)):
            where = f"{name}.{path}" if name else path
            if path not in b:
                live_only.append(where)
            elif path not in a:
                cold_only.append(where)
            elif _is_handle(a[path]) and _is_handle(b[path]):
                handles += 1
            else:
                compared += 1
                if not _same(a[path], b[path]):
                    differ.append(where)
        gemm = _gemm_differs(mod, other)
        if gemm is not None:
            gemms += 1
            if gemm:
                differ.append(f"{name}.cpu_linear (computes otherwise)")
    return {
        "ok": not differ,
        "compared": compared,
        "gemms": gemms,
        "handles": handles,
        "differ": differ[:limit],
        "differ_count": len(differ),
        "live_only": live_only[:limit],
        "cold_only": cold_only[:limit],
    }


def cold_audit(model: torch.nn.Module, vllm_config, checkpoint: str) -> dict:
    """:func:`compare` of the served ``model`` with a cold instance built from ``checkpoint`` (then freed)."""
    t = time.perf_counter()
    cold = build_cold(vllm_config, checkpoint)
    try:
        with torch.no_grad():
            out = compare(model, cold)
    finally:
        del cold
    out["seconds"] = round(time.perf_counter() - t, 3)
    return out


__all__ = ["build_cold", "cold_audit", "compare"]
