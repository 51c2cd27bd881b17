"""The per-rank half of an update, engine-agnostic: map, apply in place, verify, undo.

An :class:`Updater` lives in every rank (vLLM worker, SGLang scheduler). At start-up
it asks the layout probe where the model's own weight loader puts each checkpoint
element on this rank (:mod:`engine_ext.layout`) and fingerprints the live weights
through those maps. An apply writes a decoded delta in place through
:func:`engine_ext.apply.apply_delta` with an undo log; tensors the probe could not map
are rebuilt on the host and reloaded densely through the engine's loader. Derived
state (re-packed copies of weights) is refreshed through a hook. The controller
(:mod:`engine_ext.service`) combines the per-rank fingerprints and then calls
:meth:`commit` or :meth:`rollback` on every rank.

Decoded deltas travel from the controller to the ranks as one safetensors file in
shared memory (:func:`stage_delta` / :func:`load_staged`): decoded once, read by
every rank without a copy through the engine's RPC channel.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import time
from typing import Callable, Iterable

import torch

from . import fingerprint as fpr
from .delta import TensorDelta, apply_tensor
from .dtypes import DType, dtype_by_name, dtype_of

log = logging.getLogger("engine_ext")

Loader = Callable[[str, torch.Tensor], None]  # load one whole checkpoint tensor via the engine's loader
Refresh = Callable[["set[int] | None"], None]  # storages (data_ptr) whose derived state must be rebuilt; None: all
Describe = Callable[[], dict]  # the engine's kernels/paths on this rank, for the start-up log and status


# --------------------------------------------------------------------------- staging


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


# --------------------------------------------------------------------------- updater


class Updater:
    """This rank's maps, fingerprints and pending undo; every method returns plain JSON-able dicts."""

    def __init__(self, module: torch.nn.Module, load: Loader, checkpoint: dict[str, tuple[tuple[int, ...], DType]],
                 read_checkpoint: Callable[[str], torch.Tensor] | None = None, refresh: Refresh | None = None,
                 rank: int = 0, device: torch.device | None = None, describe: Describe | None = None):
        self.module, self.load, self.checkpoint = module, load, checkpoint
        self.read_checkpoint, self.refresh, self.rank, self.describe = read_checkpoint, refresh, rank, describe
        self.maps: dict = {}
        self.host: dict[str, torch.Tensor] = {}  # checkpoint copies of unmappable tensors (dense fallback)
        self.fps: dict[str, int] = {}  # rank-local partial fingerprints (whole for host tensors)
        self.covered: dict[str, int] = {}
        self.version: int | None = None
        self._pending = None
        self.setup_s = 0.0

    # ---- start-up
    def setup(self) -> dict:
        """Probe the loader's layout and fingerprint the live weights (idempotent)."""
        if not self.maps:
            from .apply import Unmappable, covered_elements, local_fingerprint
            from .layout import probe_layout

            t = time.perf_counter()
            specs = [(n, tuple(s), d) for n, (s, d) in self.checkpoint.items()]
            self.maps = probe_layout(self.module, self.load, specs)
            for name, m in self.maps.items():
                if isinstance(m, Unmappable):
                    if self.read_checkpoint is None:
                        raise RuntimeError(f"{name}: unmappable ({m.reason}) and no checkpoint reader for a dense fallback")
                    self.host[name] = self.read_checkpoint(name).cpu()
                    self.fps[name] = fpr.tensor_fingerprint(self.host[name])
                    self.covered[name] = self.host[name].numel()
                else:
                    self.fps[name] = local_fingerprint(m)
                    self.covered[name] = covered_elements(m)
            self.setup_s = time.perf_counter() - t
        return {"fingerprints": self.report(), "fallback": sorted(self.host), "converted": self.converted(),
                "setup_s": self.setup_s, "engine": self.describe() if self.describe else {},
                "tensors": {n: [list(s), d.name] for n, (s, d) in self.checkpoint.items()}}

    def converted(self) -> list[str]:
        """Tensors mapped through a converting piece (the engine holds a widened copy, e.g. float32 biases)."""
        from .apply import TensorMap

        return sorted(n for n, m in self.maps.items() if isinstance(m, TensorMap)
                      and any(p.dest.dtype != m.dtype.torch for p in m.pieces))

    def resync(self) -> dict:
        """Recompute the fingerprints from the live weights (after an outside dense reload)."""
        from .apply import local_fingerprint

        if self._pending is not None:
            raise RuntimeError("an applied update is neither committed nor rolled back")
        self.setup()
        for name, m in self.maps.items():
            if name not in self.host:
                self.fps[name] = local_fingerprint(m)
        return {"fingerprints": self.report()}

    def report(self, names: Iterable[str] | None = None) -> dict[str, list]:
        """``{name: [fp_hex, covered_elements, numel]}`` for the controller to combine."""
        names = self.fps if names is None else names
        return {n: [fpr.fmt(self.fps[n]), self.covered[n], _numel(self.checkpoint[n][0])] for n in names}

    # ---- apply / commit / rollback
    def apply(self, deltas: list[TensorDelta] | None = None, path: str | None = None) -> dict:
        """Apply in place, keeping an undo log until :meth:`commit` or :meth:`rollback`."""
        from .apply import apply_delta

        if self._pending is not None:
            raise RuntimeError("an applied update is neither committed nor rolled back")
        self.setup()
        t = time.perf_counter()
        deltas = load_staged(path) if deltas is None else deltas
        t_load = time.perf_counter() - t
        for td in deltas:
            if td.name not in self.checkpoint:
                raise ValueError(f"{td.name}: not a tensor of the served checkpoint")
        mapped = [td for td in deltas if td.name not in self.host]
        dense = [td for td in deltas if td.name in self.host]
        old_fps = {td.name: self.fps[td.name] for td in deltas}
        t = time.perf_counter()
        res = apply_delta(mapped, self.maps, undo=True)
        undo, old_host, storages = res.undo, {}, self._storages(mapped)
        try:
            for name, d in res.fingerprint_delta.items():
                self.fps[name] = (self.fps[name] + d) & fpr.MASK64
            parts: dict[str, list[TensorDelta]] = {}
            for td in dense:  # a composed chain may hold an absolute and a relative part of one tensor
                parts.setdefault(td.name, []).append(td)
            for name, tds in parts.items():  # rebuild on the host, reload the whole tensor through the engine's loader
                new = self.host[name]
                for td in tds:
                    new = apply_tensor(new, td, check=td is tds[-1])
                self.load(name, new)
                old_host[name], self.host[name] = self.host[name], new
                self.fps[name] = fpr.tensor_fingerprint(new)
            self._pending = (undo, old_fps, old_host, storages if not dense else None)
            self._refresh(storages if not dense else None)
        except BaseException:
            self._pending = (undo, old_fps, old_host, None)
            self.rollback()
            raise
        t_apply = time.perf_counter() - t
        return {"written": int(sum(res.written.values())) + sum(td.nnz for td in dense),
                "fingerprints": self.report(td.name for td in deltas), "fallback": sorted({td.name for td in dense}),
                "undo_bytes": undo.nbytes if undo is not None else 0,
                "load_s": t_load, "apply_s": t_apply}

    def commit(self, version: int | None = None) -> dict:
        if self._pending is not None:
            undo = self._pending[0]
            if undo is not None:
                undo.discard()
            self._pending = None
        if version is not None:
            self.version = version
        return {"version": self.version}

    def rollback(self) -> dict:
        """Restore the exact old bits of the last apply (no-op when nothing is pending)."""
        if self._pending is None:
            return {"rolled_back": False}
        undo, old_fps, old_host, storages = self._pending
        if undo is not None and not undo.done:
            undo.rollback()
        for name, old in old_host.items():
            self.load(name, old)
            self.host[name] = old
        self.fps.update(old_fps)
        self._pending = None
        self._refresh(storages)
        return {"rolled_back": True}

    def status(self) -> dict:
        return {"version": self.version, "tensors": len(self.maps), "fallback": sorted(self.host),
                "pending": self._pending is not None}

    # ---- helpers
    def _storages(self, deltas: list[TensorDelta]) -> set[int]:
        out = set()
        for td in deltas:
            for p in getattr(self.maps.get(td.name), "pieces", []):
                if p.numel:
                    out.add(p.dest.untyped_storage().data_ptr())
        return out

    def _refresh(self, storages: set[int] | None) -> None:
        if self.refresh is not None:
            self.refresh(storages)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def model_files(model: str, revision: str | None = None) -> list[str]:
    """The served checkpoint's safetensors files (a local dir, or the HF cache)."""
    if os.path.isdir(model):
        root = model
    else:
        from huggingface_hub import snapshot_download

        root = snapshot_download(model, revision=revision, allow_patterns=["*.safetensors", "*.json"], local_files_only=True)
    files = sorted(glob.glob(os.path.join(root, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors checkpoint in {root}")
    return files


def checkpoint_specs(files: Iterable[str]) -> dict[str, tuple[tuple[int, ...], DType]]:
    """Names, shapes and dtypes of a safetensors checkpoint, from the headers only."""
    from safetensors import safe_open

    from .dtypes import BY_SAFETENSORS

    out = {}
    for f in files:
        with safe_open(f, "pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                out[k] = (tuple(sl.get_shape()), BY_SAFETENSORS[sl.get_dtype()])
    return out


def checkpoint_reader(files: Iterable[str]) -> Callable[[str], torch.Tensor]:
    """A function reading one named tensor from a safetensors checkpoint."""
    from safetensors import safe_open

    where = {}
    for f in files:
        with safe_open(f, "pt") as h:
            for k in h.keys():
                where[k] = f

    def read(name: str) -> torch.Tensor:
        with safe_open(where[name], "pt") as h:
            return h.get_tensor(name)

    return read


__all__ = ["Updater", "stage_delta", "load_staged", "checkpoint_specs", "checkpoint_reader", "dtype_of"]
