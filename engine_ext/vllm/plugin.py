"""``vllm.general_plugins`` entry point: runs in every vLLM process before the model loads.

On the CPU it asks for AMX tile permission (vLLM's AMX attention otherwise can die with
SIGILL) and keeps the backend's unpacked linear weights (see :mod:`.patches`), adds the
``engine_ext`` worker RPC method and registers the ``delta`` weight-transfer backend,
so ``VLLM_PLUGINS=engine_ext`` is the whole set-up.
"""
from __future__ import annotations

import logging

log = logging.getLogger("engine_ext")
_done = False


def register() -> None:
    global _done
    if _done:
        return
    _done = True
    if not log.handlers:  # vLLM configures only its own logger; make ours visible in the server log
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("(%(processName)s pid=%(process)d) %(levelname)s %(asctime)s [engine_ext] %(message)s", "%m-%d %H:%M:%S"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False
    from vllm.platforms import current_platform

    from . import worker
    from .patches import keep_cpu_linear_weights, request_amx_permission

    if current_platform.is_cpu():
        request_amx_permission()
        keep_cpu_linear_weights()
    worker.install()
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        if "delta" not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine("delta", "engine_ext.vllm.backend", "DeltaWeightTransferEngine")
    except ImportError:  # older vLLM without weight-transfer backends
        log.info("engine_ext: vLLM has no WeightTransferEngineFactory; 'delta' backend not registered")
