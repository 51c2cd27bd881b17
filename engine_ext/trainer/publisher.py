"""Trainer side: publish each new weight version as a delta against the previous one.

``DeltaPublisher.publish`` compares the new bits with the bits it kept from the
previous version on the tensors' own device (GPU on a GPU trainer), so only the
changed positions and values ever leave the device; fingerprints are updated in
O(changed). Encoding (all cores, :mod:`engine_ext.trainer.delta_pipeline`) and upload run on a
background thread behind a bounded queue (:mod:`engine_ext.trainer.upload_worker`): ``publish``
returns the manifest URI at once and blocks only when the queue is full (backpressure); ``wait()``
drains it and re-raises upload errors. A version that fails to publish (the store down, a full
disk) is raised once, by ``publish`` or ``wait``; the versions queued behind it are skipped, and
the next version is an anchor, so that no delta ever names a base that was not published.

Versions are write-once and only grow. A publisher on a store that already holds
versions (a restarted trainer) continues after them (:mod:`engine_ext.trainer.lineage`): its first
version is a delta against LATEST's weights, rebuilt from the store and proven, or an
anchor; ``resumed`` says which. A second publisher racing it for a version gets a
:class:`~engine_ext.errors.ConflictError`. While it lives, a signing publisher re-signs
``LATEST`` before it expires (:mod:`engine_ext.trainer.heartbeat`), so followers never see a live
run go stale.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from .. import settings
from ..errors import DeltaError
from ..format import chunks, codec
from ..format import fingerprint as fpr
from ..format.delta import changed_bits
from ..format.dtypes import served_dtype, to_served
from ..format.manifest import ANCHOR, DELTA, manifest_key
from ..format.quantize import quantizer
from ..store import Store, open_store
from ..store.signing import Signer, Trust
from . import lineage
from .builder import LATEST_TTL_S, VersionBuilder
from .catch_up import CatchUp, check_spans, publish_catch_ups
from .checkpoint_layout import to_checkpoint_layout, transformers_model
from .delta_pipeline import ContextBase, DeltaEncoder, TensorChange
from .heartbeat import LatestHeartbeat
from .holdings import Described, Holding, WholeTensors
from .kept_bits import KeptBitsReaders
from .state_dict import clean_state_dict
from .upload_worker import UploadJob, UploadWorker

log = logging.getLogger("engine_ext")
RESUME_MODES = ("auto", "delta", "anchor")


@dataclass
class AnchorTensors:
    """What an anchor job writes: the kept bits themselves (no copy of the model), viewed as the served
    tensors, and their fingerprints (None: the first version, fingerprinted while it is written)."""

    tensors: dict[str, torch.Tensor]
    fingerprints: dict[str, int] | None


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
        catch_up_spans: after each version ``v``, publish the catch-up deltas ending there, one per span
            (powers of two, e.g. ``(4, 16, 64)``) dividing ``v``: a replica k versions behind then fetches
            O(log k) deltas of about the union of the changes (:mod:`engine_ext.trainer.catch_up`). Off by
            default: they cost extra stored bytes and upload time (docs/benchmarks.md, "catch-up deltas").
    """

    # Each tensor's encode starts on the pool as it is diffed (True), or after the whole diff (False): same bytes.
    # "auto": early where the diff runs on an accelerator (the cores are free); on the CPU the diff takes every core,
    # and encoding beside it made the step wait ~0.3 s longer at 1.12 B on 2 cores for ~0.4 s less until stored
    # (docs/benchmarks.md, "the 1 % delta, second pass").
    encode_early: bool | str = "auto"

    def __init__(
        self,
        store: Store | str,
        model: str = "model",
        *,
        anchor_every: int = 50,
        keep_on_cpu: bool = False,
        mode: str | None = None,
        queue_size: int = 2,
        workers: int | None = None,
        start_version: int | None = None,
        blob_target: int | None = None,
        signing_key=None,
        chunk_min_cell: int | None = chunks.MIN_CELL,
        quantize: str | None = None,
        resume: str = "auto",
        latest_ttl_s: float = LATEST_TTL_S,
        dtype: torch.dtype | str | None = torch.bfloat16,
        checkpoint_layout="auto",
        catch_up_spans=(),
    ):
        if resume not in RESUME_MODES:
            raise ValueError(f"resume must be one of {RESUME_MODES}, got {resume!r}")
        if not (checkpoint_layout in ("auto", None) or isinstance(checkpoint_layout, torch.nn.Module)):
            raise ValueError(
                f"checkpoint_layout must be 'auto', None or a transformers model, got {checkpoint_layout!r}"
            )
        if isinstance(store, (str, os.PathLike)):
            store = open_store(store)
        self.store = store
        self.model = model
        self.anchor_every = anchor_every
        self.keep_on_cpu = keep_on_cpu
        self.mode = mode
        self.workers = workers or os.cpu_count() or 1
        self.blob_target = blob_target
        self.chunk_min_cell = chunk_min_cell
        self.quantize = quantizer(quantize)
        self.dtype = served_dtype(dtype)
        self.checkpoint_layout = checkpoint_layout
        # after each version, its catch-up deltas of these spans (:mod:`engine_ext.trainer.catch_up`; off: ())
        self.catch_up_spans = check_spans(catch_up_spans)
        self.catch_ups: list[CatchUp] = []  # what they did, published or skipped, in order
        self.aliases: dict[
            str, str
        ] = {}  # names left out as aliases of a kept tensor (tied embeddings): {dropped: kept}
        self.signer = Signer(signing_key) if signing_key is not None else Signer.from_settings()
        self.trust = self._own_trust(self.signer)
        self.resume = resume
        self.latest_ttl_s = latest_ttl_s
        self.head = lineage.read_head(self.store, self.trust)
        if start_version is not None and start_version < self.head.next_version:
            raise ValueError(
                f"start_version {start_version}: {self.store.uri} already holds versions up to "
                f"v{self.head.next_version - 1}; version numbers only grow"
            )
        self.resumed: lineage.Resumed | None = None  # set by the first publish on a store that held versions
        self._manifest_shas: dict[int, list[str]] = {}  # version -> SHA-256 of its published manifests
        self.version: int | None = None
        self.next_version = self.head.next_version if start_version is None else start_version
        self.anchor_version: int | None = None
        self.last_changed = 0  # elements that changed in the last version published (all of them in a first one)
        self.last_numel = 0  # elements of the last version (in the served dtype)
        self.last_nbytes = 0  # and its bytes
        # What this publisher holds of each tensor: all of it (a ShardedPublisher's rank: its rows, once agreed).
        self._holding: Holding = WholeTensors()
        self._prev: dict[str, torch.Tensor] = {}  # the kept bits: raw bits of the last published version
        self._fps: dict[str, int] = {}  # each tensor's fingerprint in the last published version
        self._kept = KeptBitsReaders()
        self._pool = ThreadPoolExecutor(self.workers)
        self._encoder = DeltaEncoder(mode, chunk_min_cell, self._pool)
        self._uploads = UploadWorker(self._build, self._kept, queue_size)
        self._heartbeat = LatestHeartbeat(self.store, self.signer, latest_ttl_s)

    @staticmethod
    def _own_trust(signer: Signer | None) -> Trust:
        """Reading back its own store, a publisher trusts what it signed (and, unsigned, its own bytes)."""
        trust = Trust.from_settings()
        if signer:
            return trust.also_trusting(signer)
        return dataclasses.replace(trust, allow_unsigned=True)

    # -- trainer-facing -------------------------------------------------------
    def publish(self, model_or_state_dict, version: int | None = None) -> str:
        """Snapshot the changes since the last version and queue them; returns the manifest URI.

        ``model_or_state_dict``: an ``nn.Module``, a state dict, or an iterable of ``(name, tensor)``
        (TRL's parameter iterator); tied names are published once (:func:`clean_state_dict`), and
        floating-point tensors in the served ``dtype``."""
        self._uploads.raise_pending()
        sd = self._served_state_dict(model_or_state_dict)
        self.last_numel = sum(t.numel() for t in sd.values())
        self.last_nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        version = self.next_version if version is None else version
        if self.version is None and self.head.latest is not None:
            self._resume_from_latest(sd, version)
        if self.version is not None and version <= self.version:
            raise ValueError(f"version {version} must be above the last published {self.version}")
        if version < self.head.next_version:
            raise ValueError(
                f"version {version}: {self.store.uri} already holds versions up to v{self.head.next_version - 1}"
            )
        # after a version that failed to publish, the chain starts again: no delta names an unpublished base
        first = self.version is None or self._uploads.restart_chain
        is_anchor = first or bool(self.anchor_every and version % self.anchor_every == 0)
        if is_anchor:
            self.anchor_version = version
        delta_job = None
        if first:
            self._kept.wait_free()  # a job of the failed chain may still be reading the kept bits
            self._uploads.restart_chain = False
            self._fps = {}
            self._remember(sd)  # the one copy of this version: the diff's base, and what its anchor is written from
            self.last_changed = sum(t.numel() for t in sd.values())
        else:
            self._kept.wait_free()  # an anchor may still be being written from the kept bits
            self._uploads.raise_pending()
            delta_job = self._snapshot_delta(sd, version)  # the kept bits and self._fps move to this version
        # the anchor is queued first so that LATEST never names an anchor not yet written
        jobs = []
        if is_anchor:
            jobs.append(self._snapshot_anchor(sd, version, first))
        if delta_job is not None:
            jobs.append(delta_job)
        self.version = version
        self.next_version = version + 1
        for job in jobs:
            self._uploads.put(job)  # blocks when uploads fall behind: backpressure
        return self.store.key_uri(manifest_key(version, ANCHOR if first else DELTA))

    def _served_state_dict(self, model_or_state_dict) -> dict[str, torch.Tensor]:
        """What a version holds: the checkpoint the engines load, in the served dtype (or quantised)."""
        aliases: dict[str, str] = {}
        layout = self.checkpoint_layout
        if layout == "auto":
            layout = transformers_model(model_or_state_dict)
        if self.quantize is not None:  # the quantiser reads the masters; it casts what it leaves unquantised
            sd = to_checkpoint_layout(clean_state_dict(model_or_state_dict, aliases), layout)
            sd = self.quantize(sd, rest_dtype=self.dtype)
        else:
            served = clean_state_dict(model_or_state_dict, aliases, cast=lambda t: to_served(t, self.dtype))
            sd = to_checkpoint_layout(served, layout)
        if aliases != self.aliases:
            log.info(
                "engine_ext: publishing %d tied name(s) once, under the name the engines load: %s",
                len(aliases),
                ", ".join(f"{d} -> {k}" for d, k in sorted(aliases.items())),
            )
            self.aliases = aliases
        return sd

    def wait(self) -> None:
        """Block until every queued version is published; re-raise the first failure."""
        self._uploads.drain()
        self._uploads.raise_pending()

    @property
    def fingerprint(self) -> int | None:
        """The model fingerprint of the last version published (after :meth:`wait`; None before any)."""
        self._kept.wait_free()  # a first version is fingerprinted while its anchor is written
        return fpr.model_fingerprint(self._fps) if self._fps else None

    def refresh_latest(self, force: bool = False) -> bool:
        """Re-sign the LATEST this publisher wrote with a new expiry, once half its time has passed
        (or ``force``), unless another publisher moved it; returns whether it was re-signed
        (:class:`~engine_ext.trainer.heartbeat.LatestHeartbeat` does this on its own while the publisher lives)."""
        return self._heartbeat.refresh(force)

    def close(self) -> None:
        """Stop the heartbeat, publish what is queued (raising its first failure), then stop the threads."""
        self._heartbeat.stop()
        self.wait()
        self._uploads.close()
        self._pool.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

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
                    raise ValueError(
                        f"{len(differ)} tensor(s) differ in name, shape or dtype from LATEST's: {differ[:5]}"
                    )
            except (DeltaError, ValueError) as e:
                if self.resume == "delta":
                    raise ValueError(
                        f"cannot resume {self.store.uri} with a delta against v{latest.version}: {e}"
                    ) from e
                reason = f"LATEST's weights cannot serve as the base: {str(e)[:300]}"
            else:
                self._remember({n: w.to(sd[n].device) for n, w in weights.items()})
                self._fps = {t.name: fpr.parse(t.fingerprint) for t in link.manifest.tensors}
                self.version = latest.version
                self.anchor_version = link.manifest.anchor_version
                self._manifest_shas[latest.version] = list(rebuilt.manifests)
                reason = "LATEST's weights rebuilt from the store, every fingerprint proven"
        kind = "anchor" if self.version is None else "delta"
        self.resumed = lineage.Resumed(latest.version, version, kind, reason)
        log.info("engine_ext: %s: %s", self.store.uri, self.resumed)

    # -- snapshots (on the training thread, on the tensors' device) -------------
    def _snapshot_delta(self, sd: dict, version: int) -> UploadJob:
        """The changes of every tensor since the kept bits, which move to this version (with the
        fingerprints). Everything is checked before any state moves."""
        if set(sd) != set(self._prev):
            added = sorted(set(sd) - set(self._prev))[:5]
            removed = sorted(set(self._prev) - set(sd))[:5]
            raise ValueError(f"tensor names changed since version {self.version}: added {added}, removed {removed}")
        described = {name: self._holding.describe(name, t) for name, t in sd.items()}
        for name, t in sd.items():
            kept = self._prev[name]
            if kept.numel() != t.numel() or kept.element_size() != described[name].dtype.itemsize:
                raise ValueError(f"{name}: shape or dtype changed since the last version")
        changes = []
        for name, t in sd.items():
            change = self._diff(name, self._holding.bits(name, t), described[name])
            if self._encodes_early(name):
                self._encoder.start(change)  # encoded while the next tensors are diffed
            changes.append(change)
        self.last_changed = sum(c.positions.numel() for c in changes)
        reads_kept = any(c.context is not None for c in changes) or self._catch_ups_due(version)
        if reads_kept:
            self._kept.hold()  # the context coder reads its base (a catch-up its new bits) in the background
        return UploadJob(DELTA, version, self.version, self.anchor_version, changes, int(reads_kept))

    def _encodes_early(self, name: str) -> bool:
        """Whether a tensor's encode starts as soon as it is diffed (:attr:`encode_early`)."""
        if self.encode_early == "auto":
            return self._prev[name].device.type != "cpu"
        return self.encode_early is True

    def _diff(self, name: str, new: torch.Tensor, described: Described) -> TensorChange:
        """One tensor's changes since the kept bits, which move to ``new`` (flat raw bits, rows from
        ``described.first_row`` of the whole tensor), and its fingerprint updated (at global flat indices)."""
        prev = self._prev[name]
        if prev.device == new.device:
            pos, old_bits, new_bits = changed_bits(prev, new, update=True)  # the kept bits follow in the same pass
        else:
            pos, old_bits, new_bits = changed_bits(prev.to(new.device, non_blocking=True), new)
            prev[pos.to(prev.device)] = new_bits.to(prev.device)  # the kept bits follow in O(changed)
        row = described.first_row
        if row:  # positions within the whole tensor
            pos = pos + row * (math.prod(described.shape[1:]) if described.shape else 1)
        fp = fpr.update_fingerprint(self._fps[name], pos, old_bits, new_bits)
        context = None
        if settings.current().context_coder:
            policy = codec.context_policy(name, described.dtype, described.shape, pos.numel())
            if policy is not None:
                # The context coder's base is the kept bits as they are now (this version's), read in the background.
                context = ContextBase(policy, lambda: prev, origin=row)
        change = TensorChange(
            name,
            described.dtype,
            described.shape,
            pos.cpu(),
            old_bits.cpu(),
            new_bits.cpu(),
            self._fps[name],
            fp,
            context,
            self._holding.cuts(name),
        )
        self._fps[name] = fp
        return change

    def _snapshot_anchor(self, sd: dict, version: int, first: bool) -> UploadJob:
        """An anchor is written from the kept bits (no copy of its own): the next version's diff
        waits until the background has read them (:class:`~engine_ext.trainer.kept_bits.KeptBitsReaders`).
        The first version's fingerprints are computed there too, while it writes (on every core)."""
        kept = {}
        for name, t in sd.items():
            served = self._holding.describe(name, t).dtype.torch
            kept[name] = self._prev[name].view(served).reshape(t.shape)
        self._kept.hold()
        fingerprints = None if first else dict(self._fps)
        return UploadJob(ANCHOR, version, None, version, AnchorTensors(kept, fingerprints), 1)

    def _remember(self, sd: dict) -> None:
        """Keep the first version's bits; later versions update them in _snapshot_delta."""
        for name, t in sd.items():
            bits = self._holding.bits(name, t)
            self._prev[name] = bits.to("cpu" if self.keep_on_cpu else bits.device, copy=True)

    # -- background: build and publish (on the upload worker's thread) ------------
    def _build(self, job: UploadJob) -> None:
        b = self._builder(job)
        if job.kind == ANCHOR:
            self._write_anchor(b, job)
        else:
            self._encoder.write(b, job.payload)
        with self._heartbeat.moving_latest():
            b.publish(self.store, self.signer, self.latest_ttl_s)
            self._heartbeat.wrote(b.latest)
        self._published(job.version, b.manifest_sha256)
        if job.kind == DELTA and self._catch_ups_due(job.version):
            try:
                self.catch_ups += publish_catch_ups(
                    self.store,
                    job.version,
                    self.catch_up_spans,
                    trust=self.trust,
                    signer=self.signer,
                    workers=self.workers,
                    new_bits=self._kept_bits_at,
                )
            except Exception:  # an optimisation: readers still have the chain, and the version is published
                log.exception("engine_ext: the catch-up deltas to v%s failed; readers take the chain", job.version)

    def _kept_bits_at(self, name: str, positions: torch.Tensor) -> torch.Tensor:
        """The kept (last published) raw bits of ``name`` at flat ``positions``, on the CPU."""
        kept = self._prev[name].reshape(-1)
        return kept[positions.to(kept.device)].cpu()

    def _catch_ups_due(self, version: int) -> bool:
        """Whether a catch-up delta ends at ``version`` (a span divides it): its job then holds the kept bits,
        which hold ``version``'s bits until the next diff (a mixed composite is coded from them)."""
        return any(version % span == 0 for span in self.catch_up_spans)

    def _builder(self, job: UploadJob, part: int | None = None) -> VersionBuilder:
        opts = {} if self.blob_target is None else {"blob_target": self.blob_target}
        base_manifests = self._manifest_shas.get(job.base_version, []) if job.kind == DELTA else None
        return VersionBuilder(
            job.kind,
            self.model,
            job.version,
            job.base_version,
            job.anchor_version,
            base_manifests=base_manifests,
            spool_in=self.store,
            part=part,
            **opts,
        )

    def _published(self, version: int, sha256: str) -> None:
        """Remember a published manifest: the next delta names its base's manifests."""
        self._manifest_shas.setdefault(version, []).append(sha256)
        for old in sorted(self._manifest_shas)[:-2]:  # the next delta's base is one of the two newest
            del self._manifest_shas[old]

    def _write_anchor(self, b: VersionBuilder, job: UploadJob) -> None:
        anchor: AnchorTensors = job.payload
        infos = [self._holding.anchor_info(name, t) for name, t in anchor.tensors.items()]
        fingerprint = None
        if anchor.fingerprints is not None:
            fingerprints = anchor.fingerprints

            def fingerprint(name, _tensor):
                return fingerprints[name]

        b.add_anchor(infos, anchor.tensors.__getitem__, fingerprint, workers=self.workers)
        if not self._fps:  # the first version, fingerprinted as it was written: the diffs' base
            self._fps = {t.name: fpr.parse(t.fingerprint) for t in b.manifest.tensors}


class PublisherOptions(Protocol):
    """What an integration's options say of the publisher it opens (verl's ``VerlSyncOptions``, vLLM's
    ``DeltaTrainerInitInfo``): the one mapping from them to a publisher's arguments is :func:`open_publisher`."""

    store: str
    model: str
    signing_key: str | None
    anchor_every: int
    publisher: dict[str, Any]  # more DeltaPublisher arguments


PublisherKind = TypeVar("PublisherKind", bound=DeltaPublisher)


def open_publisher(kind: type[PublisherKind], options: PublisherOptions, dtype: torch.dtype | None) -> PublisherKind:
    """A publisher of ``kind`` (:class:`DeltaPublisher` or a sharded one) as ``options`` describe it, casting the
    trainer's floating-point weights to ``dtype`` (None: as they are)."""
    return kind(
        options.store,
        options.model,
        signing_key=options.signing_key,
        anchor_every=options.anchor_every,
        dtype=dtype,
        **options.publisher,
    )
