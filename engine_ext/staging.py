"""Hand a decoded delta from the process that fetched it to the ranks that apply it.

The driver of an update (the HTTP controller, or rank 0 of the in-process backend)
decodes once and writes the tensor deltas to one safetensors file in shared memory
(``/dev/shm``, or ``ENGINE_EXT_STAGE_DIR``); every rank reads it without a copy through
the engine's RPC channel. :class:`StagedDelta` owns the file's private directory and
removes it when the update ends, whatever happens.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Iterable

from . import fingerprint as fpr
from . import settings
from .delta import TensorDelta
from .dtypes import dtype_by_name

FILE_NAME = "delta.safetensors"


def stage_dir() -> str:
    """Where decoded deltas are handed to the ranks: shared memory when there is one."""
    return settings.current().stage_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())


def stage_delta(tensors: Iterable[TensorDelta], path: str) -> str:
    """Write decoded tensor deltas to one safetensors file (positions + values, metadata JSON)."""
    from safetensors.torch import save_file

    data, meta = {}, []
    for k, td in enumerate(tensors):
        data[f"{k}.v"] = td.values.contiguous().cpu()
        if td.positions is not None:
            data[f"{k}.p"] = td.positions.contiguous().cpu()
        meta.append({"name": td.name, "dtype": td.dtype.name, "shape": list(td.shape), "mode": td.mode,
                     "sparse": td.positions is not None,
                     "base_fingerprint": None if td.base_fingerprint is None else fpr.fmt(td.base_fingerprint),
                     "fingerprint": None if td.fingerprint is None else fpr.fmt(td.fingerprint)})
    save_file(data, path, metadata={"engine_ext": json.dumps(meta)})
    return path


def load_staged(path: str) -> list[TensorDelta]:
    from safetensors import safe_open

    out = []
    with safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["engine_ext"])
        for k, m in enumerate(meta):
            out.append(TensorDelta(
                m["name"], dtype_by_name(m["dtype"]), tuple(m["shape"]), m["mode"],
                f.get_tensor(f"{k}.p") if m["sparse"] else None, f.get_tensor(f"{k}.v"),
                None if m["base_fingerprint"] is None else fpr.parse(m["base_fingerprint"]),
                None if m["fingerprint"] is None else fpr.parse(m["fingerprint"])))
    return out


PREFIX = "engine_ext_"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: str | None = None) -> int:
    """Remove staging directories whose creating process is gone (a crash mid-update); returns
    how many. Directories of live processes (other servers on this host) are left alone."""
    d = directory or stage_dir()
    removed = 0
    try:
        names = os.listdir(d)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("_", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(d, name), ignore_errors=True)
            removed += 1
    return removed


class StagedDelta:
    """A decoded delta written for the ranks; ``with`` removes it (and its directory) at the end.

    The directory is private (0700, the file 0600) and named after this process, so that
    :func:`sweep_stale` can tell a crashed process's leftovers from live ones."""

    def __init__(self, tensors: Iterable[TensorDelta], directory: str | None = None):
        self.dir = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}_", dir=directory or stage_dir())
        try:
            self.path = stage_delta(tensors, os.path.join(self.dir, FILE_NAME))
            os.chmod(self.path, 0o600)
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "StagedDelta":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
