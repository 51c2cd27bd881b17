"""Trainer side: publish each new weight version as a delta against the previous one.

``DeltaPublisher.publish`` compares the new bits with the bits it kept from the
previous version on the tensors' own device (GPU on a GPU trainer), so only the
changed positions and values ever leave the device; fingerprints are updated in
O(changed). Encoding (all cores) and upload run on a background thread behind a
bounded queue: ``publish`` returns the manifest URI at once and blocks only when the
queue is full (backpressure); ``wait()`` drains it and re-raises upload errors. A version
that fails to publish (the store down, a full disk) is raised once, by ``publish`` or
``wait``; the versions queued behind it are skipped, and the next version is an anchor, so
that no delta ever names a base that was not published.

Versions are write-once and only grow. A publisher on a store that already holds
versions (a restarted trainer) continues after them (:mod:`engine_ext.trainer.lineage`): its first
version is a delta against LATEST's weights, rebuilt from the store and proven, or an
anchor; ``resumed`` says which. A second publisher racing it for a version gets a
:class:`~engine_ext.errors.ConflictError`. While it lives, a signing publisher re-signs
``LATEST`` before it expires (heartbeat), so followers never see a live run go stale.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import queue
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .. import settings
from ..format import chunks, codec, fingerprint as fpr
from ..format.delta import changed_bits
from . import lineage
from .builder import LATEST_TTL_S, VersionBuilder, sign_latest
from ..errors import ConflictError, DeltaError
from ..format.quantize import quantizer
from ..store.signing import Signer, Trust
from ..format.dtypes import as_bits, dtype_of, served_dtype, to_served
from ..format.latest import LATEST_KEY, MAX_LATEST_BYTES, Latest
from ..format.manifest import ANCHOR, DELTA, manifest_key
from ..store import Store, open_store
from .checkpoint_layout import to_checkpoint_layout, transformers_model

log = logging.getLogger("engine_ext")
RESUME_MODES = ("auto", "delta", "anchor")

# Wrappers around the whole model (torch.compile, DDP): a prefix on every name.
WHOLE_MODEL_PREFIXES = ("_orig_mod.", "module.")
# Wrappers FSDP1 and activation checkpointing put around submodules: a whole name component.
WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def _alias_key(t: torch.Tensor):
    """What makes two tensors one: the same elements of one storage, seen the same way
    (device, address of the first element, dtype, shape, strides); None for a tensor that
    aliases nothing it could be confused with (empty, meta, another tensor subclass). An FSDP2
    ``DTensor`` is keyed by its local shard and placements."""
    if hasattr(t, "to_local") and hasattr(t, "placements"):
        local = _alias_key(t.to_local())
        return None if local is None else (local, tuple(t.placements), tuple(t.shape))
    if t.numel() == 0 or t.device.type == "meta" or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return None
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def _checkpoint_names(names: list[str]) -> tuple[list[str], list[str]]:
    """(names without wrapper prefixes and components, the whole-model prefixes stripped in order)."""
    stripped = []
    while names and (p := next((p for p in WHOLE_MODEL_PREFIXES if all(n.startswith(p) for n in names)), None)):
        names = [n[len(p):] for n in names]
        stripped.append(p)
    return [".".join(c for c in n.split(".") if c not in WRAPPER_COMPONENTS) for n in names], stripped


def clean_state_dict(model_or_sd, aliases: dict[str, str] | None = None, cast=None) -> dict[str, torch.Tensor]:
    """A flat {checkpoint name: tensor} from an nn.Module, a state dict, or an iterable of
    ``(name, tensor)`` (TRL's parameter iterator), wrapper names removed, each storage once.

    A whole-model wrapper's prefix is stripped only where every name starts with it
    (repeated for nested wrappers), and submodule wrappers only as whole dot-separated
    components, so names that merely contain ``module`` or ``_orig_mod``
    (``vision_module.weight``) are left alone.

    Names that alias one storage (tied embeddings: ``state_dict()`` holds
    ``model.embed_tokens.weight`` and ``lm_head.weight``, one tensor under two names) are
    one tensor: the first in state dict / registration order is kept, which is the name
    ``named_parameters()`` and ``save_pretrained`` keep and the one vLLM and SGLang load
    (their loaders skip the tied copy). The names dropped go into ``aliases`` ({dropped:
    kept}). Tensors that only share a storage (views at other offsets or strides) stay.
    ``cast`` (e.g. to the served dtype) is applied to each kept tensor as it is taken, after
    aliases are found on the tensors as given (a cast copy aliases nothing), so an iterator
    of gathered fp32 tensors is never held whole in fp32. Only a tensor still alive is an alias
    (weak references: a gathered tensor freed once cast gives its address to the next one).
    Ties between gathered tensors cannot be seen here (:mod:`engine_ext.integrations.verl`).
    """
    from collections.abc import Mapping

    if isinstance(model_or_sd, torch.nn.Module):
        items = model_or_sd.state_dict().items()
    elif isinstance(model_or_sd, Mapping):
        items = model_or_sd.items()
    else:
        items = model_or_sd  # an iterable of (name, tensor), walked once
    names, tensors, keys, first, dropped = [], [], [], {}, {}
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            continue
        key = _alias_key(t)
        if key is not None and key in first and first[key][1]() is not None:  # alive: its address is its own
            dropped[name] = first[key][0]
            continue
        if key is not None:
            first[key] = (name, weakref.ref(t))
        names.append(name)
        keys.append(key)
        tensors.append(t.detach() if cast is None else cast(t))
    clean, prefixes = _checkpoint_names(names)
    out, key_of = {}, {}
    for name, key, t in zip(clean, keys, tensors):
        if name in out and (key is None or key != key_of[name]):
            raise ValueError(f"two tensors map to the checkpoint name {name!r}")
        out[name], key_of[name] = t, key
    if aliases is not None and dropped:
        rename = dict(zip(names, clean))
        for d, k in dropped.items():
            for p in prefixes:
                d = d[len(p):] if d.startswith(p) else d
            aliases[".".join(c for c in d.split(".") if c not in WRAPPER_COMPONENTS)] = rename[k]
    return out


@dataclass
class _Change:
    name: str
    dtype: object
    shape: tuple
    positions: torch.Tensor  # CPU int64
    new_bits: torch.Tensor  # CPU
    old_bits: torch.Tensor  # CPU
    base_fp: int
    fp: int
    kept: torch.Tensor | None = None  # the kept bits (this version's): the context coder's base, old_bits put back
    policy: int | None = None  # the tensor's block policy for the context coder
    origin: int = 0  # the first row of the tensor the kept bits hold (a sharded trainer's rank holds rows)
    early: Future | None = None  # :meth:`DeltaPublisher._encode_early`, started on the pool as soon as the diff was done

    def context_pays(self) -> bool:
        """Whether the context coder is worth trying on this tensor (a sample of the kept bits
        decides, on the background thread)."""
        return self.kept is not None and codec.context_pays(self.dtype, self.kept, self.old_bits)

    def context(self, tables: dict) -> codec.Context | None:
        """The context coder's inputs: the kept bits as they are (this version's; the coder puts
        the old bits back part by part), read on the background thread."""
        if self.kept is None or not tables.get(self.dtype.name):
            return None
        return codec.Context(self.kept.reshape(-1), self.policy, tables[self.dtype.name], origin=self.origin)


@dataclass
class _Job:
    """One manifest to build and publish on the background thread (a sharded publisher queues its own kinds)."""

    kind: str  # ANCHOR or DELTA
    version: int
    base_version: int | None
    anchor_version: int | None
    payload: object  # anchor: (kept bits by name, fingerprints or None: computed while written); delta: [_Change]
    holds: int  # times it holds the kept bits (:meth:`DeltaPublisher._hold_kept`): the next diff waits for it


class DeltaPublisher:
    """Publish versions of a model's weights to a store as deltas (plus periodic anchors).

    Args:
        store: a Store or a root URI (local path, file://, http(s)://, s3://, hf://).
        model: model identity written into manifests.
        anchor_every: write a full anchor every K versions (0: only the first).
        keep_on_cpu: keep the previous bits in CPU memory instead of on the device.
        mode: None (smaller of abs/rel per tensor), "abs" or "rel".
        queue_size: versions that may wait for upload before publish() blocks.
        signing_key: Ed25519 private key(s) (PEM path or key object) that sign every manifest
            and LATEST; default ``ENGINE_EXT_SIGNING_KEY``. Without one, versions are
            unsigned and servers take them only with ``ENGINE_EXT_ALLOW_UNSIGNED=1``.
        chunk_min_cell: big tensors are encoded per grid cell of at least this many elements,
            so each tensor-parallel rank fetches only its cells (None: never cut); see
            :mod:`engine_ext.format.chunks`.
        dtype: the served dtype (default ``torch.bfloat16``, what RL rollout servers serve and what
            :class:`~engine_ext.integrations.trl.DeltaWeightTransfer` casts to): floating-point
            tensors (16 bits and wider) are cast to it before diffing, so a trainer holding fp32
            master weights publishes the bf16 weights the servers hold; integer, bool and 8-bit
            float tensors are published as they are. ``None``: every tensor as held (a trainer
            that already holds the served dtype, or a model served in fp32/fp16 on purpose).
        quantize: None (publish the given weights) or ``"fp8-block"``: publish the fp8 checkpoint
            the servers load, quantised from the given (master) weights by
            :func:`engine_ext.format.quantize.fp8_block_state_dict` at every version, so a delta carries
            the changed fp8 bytes and scales (:mod:`engine_ext.format.quantize`). The quantiser reads
            the masters as given (never a bf16 copy of them); ``dtype`` applies to the tensors it
            leaves unquantised (embeddings, norms, gates), its scales stay float32.
        start_version: the first version (default: 0 on an empty store, else the first free
            version after the store's LATEST); never at or below a version the store holds.
        checkpoint_layout: the names and layout a version holds. ``"auto"`` (default): what
            ``save_pretrained`` would write, which is what the engines load, when ``publish`` is given a
            transformers model (transformers 5 holds MoE experts fused and a VLM's language model under
            ``model.language_model.`` in memory: :mod:`engine_ext.trainer.checkpoint_layout`), the names
            as given otherwise; a transformers model: its conversions for every ``publish``, state dicts
            and ``(name, tensor)`` iterators too (TRL's); ``None``: always the names as given.
        resume: on a store that already holds versions, what the first version is: ``"auto"``
            a delta against LATEST where its weights can be rebuilt from the store and proven,
            else an anchor; ``"delta"`` that delta or an error; ``"anchor"`` an anchor.
        latest_ttl_s: how long a signed LATEST stays valid; while the publisher lives it re-signs
            LATEST when half of that has passed (heartbeat).
    """

    # Each tensor's encode starts on the pool as it is diffed (True), or after the whole diff (False): same bytes.
    # "auto": early where the diff runs on an accelerator (the cores are free); on the CPU the diff takes every core,
    # and encoding beside it made the step wait ~0.3 s longer at 1.12 B on 2 cores for ~0.4 s less until stored
    # (docs/benchmarks.md, "the 1 % delta, second pass").
    encode_early: bool | str = "auto"

    def __init__(self, store: Store | str, model: str = "model", *, anchor_every: int = 50,
                 keep_on_cpu: bool = False, mode: str | None = None, queue_size: int = 2,
                 workers: int | None = None, start_version: int | None = None, blob_target: int | None = None,
                 signing_key=None, chunk_min_cell: int | None = chunks.MIN_CELL, quantize: str | None = None,
                 resume: str = "auto", latest_ttl_s: float = LATEST_TTL_S, dtype: torch.dtype | str | None = torch.bfloat16,
                 checkpoint_layout="auto"):
        if resume not in RESUME_MODES:
            raise ValueError(f"resume must be one of {RESUME_MODES}, got {resume!r}")
        self.store = open_store(store) if isinstance(store, (str, os.PathLike)) else store
        self.model, self.anchor_every, self.keep_on_cpu, self.mode = model, anchor_every, keep_on_cpu, mode
        self.workers = workers or os.cpu_count() or 1
        self.blob_target, self.chunk_min_cell = blob_target, chunk_min_cell
        self.quantize = quantizer(quantize)
        self.dtype = served_dtype(dtype)
        if not (checkpoint_layout in ("auto", None) or isinstance(checkpoint_layout, torch.nn.Module)):
            raise ValueError(f"checkpoint_layout must be 'auto', None or a transformers model, got {checkpoint_layout!r}")
        self.checkpoint_layout = checkpoint_layout
        self.aliases: dict[str, str] = {}  # names left out as aliases of a kept tensor (tied embeddings): {dropped: kept}
        self.signer = Signer(signing_key) if signing_key is not None else Signer.from_settings()
        # Reading back its own store, a publisher trusts what it signed (and, unsigned, its own bytes).
        trust = Trust.from_settings()
        self.trust = trust.also_trusting(self.signer) if self.signer else dataclasses.replace(trust, allow_unsigned=True)
        self.resume, self.latest_ttl_s = resume, latest_ttl_s
        self.head = lineage.read_head(self.store, self.trust)
        if start_version is not None and start_version < self.head.next_version:
            raise ValueError(f"start_version {start_version}: {self.store.uri} already holds versions up to "
                             f"v{self.head.next_version - 1}; version numbers only grow")
        self.resumed: lineage.Resumed | None = None  # set by the first publish on a store that held versions
        self._manifest_shas: dict[int, list[str]] = {}  # version -> SHA-256 of its published manifests
        self.version: int | None = None
        self.next_version = self.head.next_version if start_version is None else start_version
        self.anchor_version: int | None = None
        self._latest: Latest | None = None  # the last LATEST this publisher wrote (the heartbeat re-signs it)
        self._latest_lock = threading.Lock()
        self._closed = threading.Event()
        self._kept_free = threading.Event()  # clear while anchors or context-coded deltas read the kept bits
        self._kept_free.set()
        self._kept_readers = 0  # queued jobs that read the kept bits (under _kept_lock)
        self._kept_lock = threading.Lock()
        self.last_changed = 0  # elements that changed in the last version published (all of them in a first one)
        self.last_numel = self.last_nbytes = 0  # elements and bytes of the last version (in the served dtype)
        self._prev: dict[str, torch.Tensor] = {}  # raw bits of the last published version
        self._fps: dict[str, int] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
        self._restart_chain = False  # a version failed to publish: the next one is an anchor
        self._lost: ConflictError | None = None  # another publisher took this store over: this one stops
        self._pool = ThreadPoolExecutor(self.workers)
        self._thread = threading.Thread(target=self._upload_loop, name="engine-ext-publisher", daemon=True)
        self._thread.start()
        self._heartbeat = None
        if self.signer is not None:
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="engine-ext-latest-heartbeat", daemon=True)
            self._heartbeat.start()

    # -- trainer-facing -------------------------------------------------------
    def publish(self, model_or_state_dict, version: int | None = None) -> str:
        """Snapshot the changes since the last version and queue them; returns the manifest URI.

        ``model_or_state_dict``: an ``nn.Module``, a state dict, or an iterable of ``(name, tensor)``
        (TRL's parameter iterator); tied names are published once (:func:`clean_state_dict`), and
        floating-point tensors in the served ``dtype``."""
        self._raise_pending()
        aliases: dict[str, str] = {}
        layout = self.checkpoint_layout if self.checkpoint_layout != "auto" else transformers_model(model_or_state_dict)
        if self.quantize is not None:  # the quantiser reads the masters; it casts what it leaves unquantised
            sd = to_checkpoint_layout(clean_state_dict(model_or_state_dict, aliases), layout)
            sd = self.quantize(sd, rest_dtype=self.dtype)
        else:
            sd = to_checkpoint_layout(clean_state_dict(model_or_state_dict, aliases,
                                                       cast=lambda t: to_served(t, self.dtype)), layout)
        if aliases != self.aliases:
            log.info("engine_ext: publishing %d tied name(s) once, under the name the engines load: %s",
                     len(aliases), ", ".join(f"{d} -> {k}" for d, k in sorted(aliases.items())))
            self.aliases = aliases
        self.last_numel = sum(t.numel() for t in sd.values())
        self.last_nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        version = self.next_version if version is None else version
        if self.version is None and self.head.latest is not None:
            self._resume_from_latest(sd, version)
        if self.version is not None and version <= self.version:
            raise ValueError(f"version {version} must be above the last published {self.version}")
        if version < self.head.next_version:
            raise ValueError(f"version {version}: {self.store.uri} already holds versions up to v{self.head.next_version - 1}")
        # after a version that failed to publish, the chain starts again: no delta names an unpublished base
        first = self.version is None or self._restart_chain
        is_anchor = first or bool(self.anchor_every and version % self.anchor_every == 0)
        if is_anchor:
            self.anchor_version = version
        if first:
            self._kept_free.wait()  # a job of the failed chain may still be reading the kept bits
            self._restart_chain, self._fps = False, {}
            self._remember(sd)  # the one copy of this version: the diff's base, and what its anchor is written from
            delta_job = None
            self.last_changed = sum(t.numel() for t in sd.values())
        else:
            self._kept_free.wait()  # an anchor may still be being written from the kept bits
            self._raise_pending()
            delta_job = self._snapshot_delta(sd, version)  # the kept bits and self._fps move to this version
        # the anchor is queued first so that LATEST never names an anchor not yet written
        jobs = ([self._snapshot_anchor(sd, version, first)] if is_anchor else []) + ([delta_job] if delta_job else [])
        self.version, self.next_version = version, version + 1
        for job in jobs:
            self._queue.put(job)  # blocks when uploads fall behind: backpressure
        return self.store.key_uri(manifest_key(version, ANCHOR if first else DELTA))

    def wait(self) -> None:
        """Block until every queued version is published; re-raise the first failure."""
        self._queue.join()
        self._raise_pending()

    @property
    def fingerprint(self) -> int | None:
        """The model fingerprint of the last version published (after :meth:`wait`; None before any)."""
        self._kept_free.wait()  # a first version is fingerprinted while its anchor is written
        return fpr.model_fingerprint(self._fps) if self._fps else None

    def close(self) -> None:
        self._closed.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        self.wait()
        self._queue.put(None)
        self._thread.join(), self._pool.shutdown()

    # -- resuming a store that already holds versions -----------------------------
    def _resume_from_latest(self, sd: dict, version: int) -> None:
        """Before the first version on a store that holds versions: take LATEST's weights as the
        previous version when they can be rebuilt from the store and proven (the first version is
        then a delta against them), else leave the first version an anchor; record which."""
        latest = self.head.latest
        reason = "resume='anchor'"
        if self.resume != "anchor":
            try:
                rebuilt = lineage.rebuild(self.store, latest, self.trust)
                weights, link = rebuilt.weights, rebuilt.target
                want = {n: (tuple(t.shape), t.dtype) for n, t in weights.items()}
                have = {n: (tuple(t.shape), t.dtype) for n, t in sd.items()}
                if want != have:
                    differ = sorted(n for n in set(want) | set(have) if want.get(n) != have.get(n))
                    raise ValueError(f"{len(differ)} tensor(s) differ in name, shape or dtype from LATEST's: {differ[:5]}")
            except (DeltaError, ValueError) as e:
                if self.resume == "delta":
                    raise ValueError(f"cannot resume {self.store.uri} with a delta against v{latest.version}: {e}") from e
                reason = f"LATEST's weights cannot serve as the base: {str(e)[:300]}"
            else:
                self._remember({n: w.to(sd[n].device) for n, w in weights.items()})
                self._fps = {t.name: fpr.parse(t.fingerprint) for t in link.manifest.tensors}
                self.version, self.anchor_version = latest.version, link.manifest.anchor_version
                self._manifest_shas[latest.version] = list(rebuilt.manifests)
                reason = "LATEST's weights rebuilt from the store, every fingerprint proven"
        self.resumed = lineage.Resumed(latest.version, version, "delta" if self.version is not None else "anchor", reason)
        log.info("engine_ext: %s: %s", self.store.uri, self.resumed)

    # -- heartbeat: a live publisher's LATEST never expires ------------------------
    def _heartbeat_loop(self) -> None:
        while not self._closed.wait(min(self.latest_ttl_s / 4, 3600.0)):
            try:
                self.refresh_latest()
            except Exception as e:  # noqa: BLE001 - the next beat tries again; publishing goes on
                log.warning("engine_ext: re-signing %s failed: %s", self.store.key_uri(LATEST_KEY), e)

    def refresh_latest(self, force: bool = False) -> bool:
        """Re-sign the LATEST this publisher wrote with a new expiry, once half its time has passed
        (or ``force``), unless another publisher moved it; returns whether it was re-signed."""
        with self._latest_lock:
            mine = self._latest
            if mine is None or self.signer is None:
                return False
            if not force and mine.expires_unix - time.time() > self.latest_ttl_s / 2:
                return False
            fresh = dataclasses.replace(mine, expires_unix=time.time() + self.latest_ttl_s)

            def still_mine(current: bytes | None) -> None:
                held = None if current is None else Latest.from_json(current)[0]
                if held is None or (held.version, held.sha256) != (mine.version, mine.sha256):
                    raise ConflictError(f"LATEST of {self.store.uri} moved to "
                                        f"{'nothing' if held is None else f'v{held.version}'}; not re-signed")

            try:
                self.store.write_if(LATEST_KEY, sign_latest(fresh, self.signer), still_mine, MAX_LATEST_BYTES)
            except ConflictError as e:
                self._latest = None  # another publisher owns LATEST now: stop beating
                log.warning("engine_ext: %s", e)
                return False
            self._latest = fresh
            return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- snapshots (on the training thread, on the tensors' device) -------------
    # What a tensor of the state dict is (a sharded publisher's are row slices, maybe cast on the way).
    def _describe(self, name: str, t: torch.Tensor) -> tuple:
        """(served dtype, the whole tensor's shape, the first row ``t`` holds) of a state-dict entry."""
        return dtype_of(t), tuple(t.shape), 0

    def _bits(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The flat raw bits of a state-dict entry as served (made one tensor at a time)."""
        return as_bits(t.detach()).reshape(-1)

    def _snapshot_delta(self, sd, version) -> _Job:
        if set(sd) != set(self._prev):
            raise ValueError(f"tensor names changed since version {self.version}: "
                             f"added {sorted(set(sd) - set(self._prev))[:5]}, removed {sorted(set(self._prev) - set(sd))[:5]}")
        described = {name: self._describe(name, t) for name, t in sd.items()}
        for name, t in sd.items():  # all checked before any state moves
            if self._prev[name].numel() != t.numel() or self._prev[name].element_size() != described[name][0].itemsize:
                raise ValueError(f"{name}: shape or dtype changed since the last version")
        changes = []
        for name, t in sd.items():
            c = self._diff(name, self._bits(name, t), *described[name])
            if self.encode_early is True or (self.encode_early == "auto" and self._prev[name].device.type != "cpu"):
                c.early = self._pool.submit(self._encode_early, c)  # encoded while the next tensors are diffed
            changes.append(c)
        self.last_changed = sum(c.positions.numel() for c in changes)
        if any(c.kept is not None for c in changes):
            self._hold_kept()  # the context coder reads its base from the kept bits, in the background
        return _Job(DELTA, version, self.version, self.anchor_version, changes, int(any(c.kept is not None for c in changes)))

    def _diff(self, name: str, new: torch.Tensor, dtype, shape: tuple, row: int) -> _Change:
        """One tensor's changes since the kept bits, which move to ``new`` (flat raw bits, rows from
        ``row`` of a tensor of ``shape``), and its fingerprint updated (at global flat indices)."""
        prev = self._prev[name]
        if prev.device == new.device:
            pos, ob, nb = changed_bits(prev, new, update=True)  # the kept bits follow in the same pass
        else:
            pos, ob, nb = changed_bits(prev.to(new.device, non_blocking=True), new)
            prev[pos.to(prev.device)] = nb.to(prev.device)  # the kept bits follow in O(changed)
        if row:
            pos = pos + row * (math.prod(shape[1:]) if shape else 1)
        fp = fpr.update_fingerprint(self._fps[name], pos, ob, nb)
        policy = codec.context_policy(name, dtype, shape, pos.numel()) if settings.current().context_coder else None
        change = _Change(name, dtype, shape, pos.cpu(), nb.cpu(), ob.cpu(), self._fps[name], fp,
                         None if policy is None else prev, policy, row)
        self._fps[name] = fp
        return change

    def _hold_kept(self) -> None:
        """A queued job will read the kept bits: the next diff (which moves them) waits for it."""
        with self._kept_lock:
            self._kept_readers += 1
            self._kept_free.clear()

    def _release_kept(self) -> None:
        with self._kept_lock:
            self._kept_readers -= 1
            if self._kept_readers == 0:
                self._kept_free.set()

    def _snapshot_anchor(self, sd, version, first: bool) -> _Job:
        """An anchor is written from the kept bits (no copy of its own): the next version's diff
        waits until the background has read them (:attr:`_kept_free`). The first version's
        fingerprints are computed there too, while it writes (on every core)."""
        kept = {n: self._prev[n].view(self._describe(n, t)[0].torch).reshape(t.shape) for n, t in sd.items()}
        self._hold_kept()
        return _Job(ANCHOR, version, None, version, (kept, None if first else dict(self._fps)), 1)

    def _remember(self, sd):
        """Keep the first version's bits; later versions update them in _snapshot_delta."""
        for name, t in sd.items():
            bits = self._bits(name, t)
            self._prev[name] = bits.to("cpu" if self.keep_on_cpu else bits.device, copy=True)

    # -- background encode + upload --------------------------------------------
    def _upload_loop(self):
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if self._error is None:
                    self._build(job)
            except BaseException as e:  # surfaced by publish()/wait()
                self._error = e
            finally:
                for _ in range(job.holds if job is not None else 0):
                    self._release_kept()  # done reading the kept bits, written or not
                job = None  # its changes are freed now, not when the next version arrives (the next diff reuses the memory)
                self._queue.task_done()

    def _build(self, job: _Job) -> None:
        b = self._builder(job)
        if job.kind == ANCHOR:
            self._write_anchor(b, job)
        else:
            self._write_delta(b, job.payload, self._step_tables)
        with self._latest_lock:
            b.publish(self.store, self.signer, self.latest_ttl_s)
            self._latest = b.latest
        self._published(job.version, b.manifest_sha256)

    def _builder(self, job: _Job, part: int | None = None) -> VersionBuilder:
        opts = {} if self.blob_target is None else {"blob_target": self.blob_target}
        return VersionBuilder(job.kind, self.model, job.version, job.base_version, job.anchor_version,
                              base_manifests=self._manifest_shas.get(job.base_version, []) if job.kind == DELTA else None,
                              spool_in=self.store, part=part, **opts)

    def _published(self, version: int, sha256: str) -> None:
        """Remember a published manifest: the next delta names its base's manifests."""
        self._manifest_shas.setdefault(version, []).append(sha256)
        for old in sorted(self._manifest_shas)[:-2]:  # the next delta's base is one of the two newest
            del self._manifest_shas[old]

    def _anchor_info(self, name: str, t: torch.Tensor) -> tuple:
        """What :meth:`VersionBuilder.add_anchor` writes of a kept tensor: (name, dtype, shape)."""
        return name, dtype_of(t), tuple(t.shape)

    def _write_anchor(self, b: VersionBuilder, job: _Job) -> None:
        tensors, fps = job.payload
        b.add_anchor([self._anchor_info(n, t) for n, t in tensors.items()], tensors.__getitem__,
                     None if fps is None else (lambda name, _: fps[name]), workers=self.workers)
        if not self._fps:  # the first version, fingerprinted as it was written: the diffs' base
            self._fps = {t.name: fpr.parse(t.fingerprint) for t in b.manifest.tensors}

    def _step_tables(self, histograms: dict) -> dict:
        """The version's step tables from its step histograms (a sharded publisher sums its ranks')."""
        return codec.step_tables_from(histograms)

    def _cuts(self, c: _Change):
        """The grid a changed tensor is cut into (None: the usual, :func:`engine_ext.format.chunks.grid`)."""
        return None

    def _encode(self, c: _Change, context: codec.Context | None):
        """A change's encoding (None: unchanged), as :func:`engine_ext.format.codec.encode_tensor` gives it."""
        if c.positions.numel() == 0:
            return None
        return codec.encode_tensor(c.dtype, c.shape, c.positions, c.new_bits, c.old_bits, self.mode,
                                   self.chunk_min_cell, context, self._cuts(c))

    def _encode_early(self, c: _Change) -> tuple[bool, object]:
        """(whether the context coder is tried on the change, its encoding where it is not), on the pool as
        soon as the tensor is diffed: it overlaps the next tensors' diff. A tensor the context coder is tried
        on waits for the version's step tables, built from every tensor's changes (:meth:`_write_delta`)."""
        return (True, None) if c.context_pays() else (False, self._encode(c, None))

    def _write_delta(self, b: VersionBuilder, payload: list[_Change], agree) -> None:
        """Encode every change (on the pool) into the builder, each hashed and appended in order as soon as it is
        encoded; ``agree(histograms)`` gives the step tables. An encode started at the diff (``early``) gives the
        bytes encoding here would: the same function of the same inputs (only context-coded tensors need tables)."""
        early = [None if c.early is None else c.early.result() for c in payload]  # (tried, encoding), started at the diff
        tried = [c.context_pays() if e is None else e[0] for c, e in zip(payload, early)]  # else a sample of each: cheap
        encodings = [None if t else self._pool.submit(self._encode, c, None) if e is None else e[1]
                     for c, t, e in zip(payload, tried, early)]  # the plain ones start now, and go on while the tables are agreed
        # the step tables come from the tensors whose sample promises a gain (none where changes are uniform)
        tables = agree(codec.step_histograms((c.dtype, c.old_bits, c.new_bits) for c, t in zip(payload, tried) if t))
        encodings = [self._pool.submit(self._encode, c, c.context(tables)) if t else e for c, t, e in zip(payload, tried, encodings)]
        for c, e in zip(payload, encodings):
            e = e.result() if isinstance(e, Future) else e
            if e is None:
                b.add_unchanged(c.name, c.dtype, c.shape, c.fp)
            else:
                b.add_encoded(c.name, c.dtype, c.shape, c.positions.numel(), e, c.base_fp, c.fp)
                if codec.uses_context(e):
                    b.add_step_tables(c.dtype.name, tables[c.dtype.name])
            c.early = None  # its encoding is in the builder: not held twice

    def _raise_pending(self):
        """Raise the first failure of the background (once). Every version queued after it was skipped,
        so none of them is published: the next :meth:`publish` writes an anchor. A
        :class:`~engine_ext.errors.ConflictError` (another publisher took a version of this store) is
        raised as such and stops this publisher for good: every later call raises it again."""
        if self._lost is not None:
            raise ConflictError(f"this publisher stopped: {self._lost}") from self._lost
        if self._error is not None:
            e, self._error = self._error, None
            if isinstance(e, ConflictError):
                self._lost = e
                raise ConflictError(f"{e}; this publisher stops (a new DeltaPublisher continues the store after "
                                    "the other one's versions)") from e
            self._restart_chain = True
            raise RuntimeError(f"publishing failed: {e}") from e
