"""engine-ext: delta weight sync for async RL (README.md).

The names users reach for, importable from the package itself and imported only when
first used, so that ``import engine_ext`` costs nothing (no torch, no store backends)::

    from engine_ext import DeltaPublisher, Fleet

Where everything else lives: ``format/`` (the byte format), ``store/`` (stores, signing,
verified reads and routes), ``trainer/`` (publisher), ``server/`` (the update transaction
and its ranks), ``engines/`` (vLLM and SGLang adapters); ``cli``, ``fleet``, ``settings``,
``errors`` and ``metrics`` at the top.
"""

from __future__ import annotations

import importlib

#: public name -> the module that defines it
PUBLIC = {
    "DeltaPublisher": "engine_ext.trainer.publisher",
    "ShardedPublisher": "engine_ext.trainer.sharded",
    "Fleet": "engine_ext.fleet",
    "open_store": "engine_ext.store",
    "generate_key": "engine_ext.store.signing",
    "Signer": "engine_ext.store.signing",
    "Trust": "engine_ext.store.signing",
    "load_delta": "engine_ext.store.reader",
    "resolve": "engine_ext.store.route",
    "DeltaError": "engine_ext.errors",
}
__all__ = sorted(PUBLIC)  # noqa: PLE0605 - the lazy face: the names are PUBLIC's keys, imported when first used


def __getattr__(name: str):
    module = PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'engine_ext' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(PUBLIC))
