"""Test-only fault injection into the engine servers the tests start (never part of the package).

A test puts this directory on a server's ``PYTHONPATH`` and names a flag file in
``ENGINE_EXT_TEST_FAULT``. In every process of the server, once the per-rank updater
module is imported, ``RankUpdater.apply`` runs as usual (its part is written in place
and an undo log kept) and then, on the rank whose number the flag file holds, deletes
the file and raises: a rank that fails in the middle of an update, after writing. One
fault per arming (write the rank number into the file to arm it).
"""
import importlib.abc
import importlib.util
import os
import sys

FLAG = os.environ.get("ENGINE_EXT_TEST_FAULT")
MODULE = "engine_ext.rank"  # where RankUpdater lives


def _armed_for() -> int | None:
    try:
        with open(FLAG) as f:
            return int(f.read().strip())
    except (OSError, ValueError, TypeError):
        return None


def _patch(module) -> None:
    original = module.RankUpdater.apply

    def apply(self, *args, **kwargs):
        reply = original(self, *args, **kwargs)
        if _armed_for() == self.rank:
            os.unlink(FLAG)
            raise RuntimeError(f"injected fault on rank {self.rank}, after its apply wrote its part")
        return reply

    module.RankUpdater.apply = apply


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if FLAG:
    sys.meta_path.insert(0, _PatchOnImport())
