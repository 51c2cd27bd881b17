"""One update of the served weights, all ranks or none: the transaction every entry point runs.

The HTTP routes on vLLM and SGLang, the in-process SGLang ``Engine`` hook and vLLM's
``delta`` weight-transfer backend all drive the same :class:`UpdateTransaction` from
one place (the *driver*: the API server process, SGLang's TokenizerManager, or rank 0
of the in-process engine). They differ only in how the driver reaches the ranks, the
small :class:`Ranks` protocol each engine adapter implements. The lifecycle, in order
(docs/TRANSACTION.md draws it):

1. :meth:`UpdateTransaction.plan`: signed manifests only; the route from the served version.
2. :meth:`UpdateTransaction.fetch`: blobs fetched, verified, decoded, composed.
3. :meth:`UpdateTransaction.stage`: the decoded delta handed to the ranks.
4. :meth:`UpdateTransaction.apply`: paused; every rank writes in place with undo.
5. :meth:`UpdateTransaction.verify`: per-rank fingerprints combined and checked.
6. :meth:`UpdateTransaction.commit` or :meth:`UpdateTransaction.rollback`: everywhere.
7. :meth:`UpdateTransaction.finish`: caches reset, version label set, resumed.

Steps 1-3 (:meth:`UpdateTransaction.prepare`) touch no rank and may run while other
updates run; steps 4-7 (:meth:`UpdateTransaction.execute`) run under the driver's
update lock, only if the served state is still the one step 1 planned from. A
:class:`ServedState` is what the driver knows about the served weights; only a commit
changes it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from . import fingerprint as fpr
from . import reader, settings
from .errors import BaseMismatchError, DeltaError, VerifyError
from .format import ANCHOR
from .protocol import RankReply, UpdateAnswer, UpdateRequest
from .signing import Trust
from .staging import StagedDelta

log = logging.getLogger("engine_ext")


class ApplyError(DeltaError):
    """A rank failed (kernel error, unknown tensor, loader failure)."""

    reason, http_status = "apply", 500


# --------------------------------------------------------------------------- reaching the ranks


class Ranks(Protocol):
    """How a driver reaches every rank of one engine (one implementation per engine and entry point)."""

    async def call(self, op: str, **kwargs) -> list[RankReply]:
        """Run ``op`` of :class:`engine_ext.rank.RankUpdater` on every rank; one reply each, in rank order."""

    async def pause(self, mode: str) -> None:
        """Stop generation steps so no forward pass reads weights mid-write (``keep``, ``wait`` or ``abort``)."""

    async def resume(self) -> None:
        """Let generation continue (always called after :meth:`pause`, whatever happened)."""

    async def after_update(self, version: int) -> None:
        """Drop caches computed with the old weights (prefix/radix KV) and set the engine's weight version label."""


def check_replies(replies: list[RankReply]) -> list[RankReply]:
    """The replies, or :class:`ApplyError` naming every rank that failed and why."""
    failed = [r for r in replies if not r.ok]
    if failed:
        raise ApplyError("; ".join(f"rank {r.rank}: {r.error}" for r in failed))
    return replies


def combine_fingerprints(replies: list[RankReply], names=None) -> dict[str, int]:
    """The whole-tensor fingerprints from every rank's :class:`~engine_ext.protocol.TensorReport`.

    A rank that covers every element of a tensor holds its whole fingerprint (and all
    such ranks must agree); otherwise the ranks hold disjoint shards whose partial sums
    add up, which needs their element counts to add up to the tensor.
    """
    names = sorted({n for r in replies for n in r.fingerprints}) if names is None else names
    out = {}
    for name in names:
        entries = [r.fingerprints[name] for r in replies if name in r.fingerprints]
        if not entries:
            raise VerifyError(f"{name}: no rank holds this tensor")
        numel = entries[0].numel
        whole = {e.fingerprint for e in entries if e.whole}
        if len(whole) > 1:
            raise VerifyError(f"{name}: ranks holding the whole tensor disagree ({sorted(fpr.fmt(f) for f in whole)})")
        if whole:
            out[name] = whole.pop()
            continue
        covered = sum(e.covered for e in entries)
        if covered != numel:
            raise VerifyError(f"{name}: ranks cover {covered} of {numel} elements (overlapping or missing shards), cannot verify")
        out[name] = sum(e.fingerprint for e in entries) & fpr.MASK64
    return out


# --------------------------------------------------------------------------- what the driver knows


@dataclass
class ServedState:
    """The served weights as the driver knows them: version, per-tensor fingerprints, checkpoint
    tensors, the SHA-256 of the manifest(s) that produced them (empty for a checkpoint the
    server started from) and the start-up layout (dense fallback, converting maps, engine
    paths per rank)."""

    version: int | None
    tensor_fps: dict[str, int]
    tensors: dict[str, tuple[tuple[int, ...], str]]
    layout: dict = field(default_factory=dict)
    manifests: tuple[str, ...] = ()

    def key(self) -> tuple:
        """What a planned route depends on: changes only when an update commits."""
        return self.version, self.model_fingerprint, self.manifests

    @classmethod
    def from_setup(cls, replies: list[RankReply], version: int | None) -> "ServedState":
        check_replies(replies)
        layout = {"fallback": sorted({n for r in replies for n in r.fallback}),
                  "converted": sorted({n for r in replies for n in r.converted}),
                  "engine": [r.engine for r in replies]}
        return cls(version, combine_fingerprints(replies), replies[0].tensors, layout)

    @property
    def model_fingerprint(self) -> int:
        return fpr.model_fingerprint(self.tensor_fps)


# --------------------------------------------------------------------------- the transaction


def _ms(s: float) -> float:
    return round(s * 1000, 3)


class UpdateTransaction:
    """Take the served weights from ``state`` to the version at ``source``, on every rank or none.

    ``source`` is the request's URL after the allow-list check. :meth:`prepare` then
    :meth:`execute` (or :meth:`run`, both) perform the steps in order; each records its
    time in :attr:`phases` (seconds).
    """

    def __init__(self, ranks: Ranks, state: ServedState, request: UpdateRequest, source: str,
                 trust: Trust | None = None):
        self.ranks, self.state, self.request, self.source = ranks, state, request, source
        self.trust = trust or Trust.from_settings()
        self.phases: dict[str, float] = {}
        self.planned_from: tuple | None = None
        self.store = None
        self.limits = reader.Limits()
        self.chain: list[reader.Link] = []
        self.delta: reader.DecodedDelta | None = None
        self.replies: list[RankReply] = []
        self.new_fps: dict[str, int] = {}
        self.base_version = state.version
        self._t0 = time.perf_counter()

    async def run(self) -> UpdateAnswer:
        staged = await self.prepare()
        try:
            return await self.execute(staged)
        finally:
            if staged is not None:
                staged.remove()

    async def prepare(self) -> StagedDelta | None:
        """Steps 1-3, touching no rank: the staged delta, or None when the target is already served."""
        self.planned_from = self.state.key()
        await self._timed("plan", asyncio.to_thread(self.plan))
        if not self.chain:
            return None
        await self._timed("fetch_decode", asyncio.to_thread(self.fetch))
        return await self._timed("stage", asyncio.to_thread(self.stage))

    async def execute(self, staged: StagedDelta | None) -> UpdateAnswer:
        """Steps 4-7 on every rank; call with the driver's update lock held, on the state
        :meth:`prepare` planned from (BaseMismatchError otherwise)."""
        if self.state.key() != self.planned_from:
            raise BaseMismatchError("the served weights changed while this update was being fetched")
        if staged is None:
            return self.answer(noop=True)
        t_pause = time.perf_counter()
        await self._timed("pause_enter", self.ranks.pause(self.request.pause_mode))
        try:
            await self._timed("apply", self.apply(staged))
            try:
                self._timed_sync("verify", self.verify)
            except BaseException:
                await self._timed("rollback", self.rollback())
                raise
            await self._timed("commit", self.commit())
            await self._timed("reset_cache", self.finish())
        finally:
            await self._timed("resume", self.ranks.resume())
        self.phases["pause"] = time.perf_counter() - t_pause
        return self.answer()

    # ---- steps (each docstring says when it runs and why)
    def plan(self) -> None:
        """First, before any blob is read and outside the update lock: choose the manifests that
        lead from the served weights to the target (the delta itself, a chain, or an anchor plus
        chain: the fewest bytes), each verified against the trusted keys before it is parsed and
        bound to the next by SHA-256, within the model's limits, and refuse, from the manifests
        alone, a route that starts elsewhere, a version older than the served one (unless the
        request says ``rollback``) or a tensor the served model does not hold with that shape
        and dtype. An empty route: the target is what is served (a replay)."""
        if self.request.base_version is not None and self.request.base_version != self.state.version:
            raise BaseMismatchError(f"request expects base version {self.request.base_version}, "
                                    f"server holds {self.state.version}")
        self.limits = reader.Limits.for_model(self.state.tensors)
        self.store, self.chain = reader.plan(
            self.source, self.state.version, self.state.model_fingerprint, have_manifests=self.state.manifests,
            trust=self.trust, limits=self.limits, allow_older=self.request.rollback,
            deadline=time.monotonic() + settings.current().fetch_timeout)
        if not self.chain:
            return
        first = self.chain[0].manifest
        if first.kind != ANCHOR:
            base_fp = fpr.parse(first.base_fingerprint)
            if base_fp != self.state.model_fingerprint or (
                    self.state.version is not None and first.base_version != self.state.version):
                raise BaseMismatchError(
                    f"v{first.version} applies to version {first.base_version} (fingerprint {first.base_fingerprint}); "
                    f"server holds version {self.state.version} (fingerprint {fpr.fmt(self.state.model_fingerprint)})")
        for link in self.chain:
            reader.check_expected(link.manifest, self.state.tensors, self.store.key_uri(link.key))

    def fetch(self) -> None:
        """While the engine still serves, outside the update lock, before the fetch deadline: fetch
        every planned manifest's blobs, verify their sizes and SHA-256, decode (bounded by the
        manifests' counts and the model's limits) and compose a chain into one delta per tensor."""
        self.delta = reader.fetch_planned(self.store, self.chain, limits=self.limits)

    def stage(self) -> StagedDelta:
        """Still serving: write the decoded delta once where every rank can read it without a copy."""
        return StagedDelta(self.delta.tensors)

    async def apply(self, staged: StagedDelta) -> None:
        """Paused: every rank writes its part in place and keeps an undo log; any rank's failure rolls
        every rank back (ranks that did not fail hold a pending apply)."""
        self.replies = await self.ranks.call("apply", path=staged.path)
        try:
            check_replies(self.replies)
        except BaseException:
            await self._timed("rollback", self.rollback())
            raise

    def verify(self) -> None:
        """Paused, after every rank applied: the fingerprints combined over ranks must equal every
        per-tensor fingerprint and the model fingerprint the manifest promises (a wrong base or a
        misapplied element shows here)."""
        names = [td.name for td in self.delta.tensors]
        got = combine_fingerprints(self.replies, names)
        bad = [f"{td.name}: {fpr.fmt(got[td.name])} != {fpr.fmt(td.fingerprint)}" for td in self.delta.tensors
               if td.fingerprint is not None and got[td.name] != td.fingerprint]
        if bad:
            raise VerifyError(f"fingerprint mismatch after apply in {len(bad)} tensor(s), rolled back: " + "; ".join(bad[:5]))
        new = dict(self.state.tensor_fps) | got
        if fpr.model_fingerprint(new) != self.delta.fingerprint:
            raise VerifyError(f"model fingerprint after apply {fpr.fmt(fpr.model_fingerprint(new))} != "
                              f"manifest's {fpr.fmt(self.delta.fingerprint)}, rolled back")
        self.new_fps = new

    async def commit(self) -> None:
        """Verified: every rank drops its undo log and records the version; the served state moves
        (and remembers the manifest it came from, which the next delta must name as its base)."""
        check_replies(await self.ranks.call("commit", version=self.delta.version))
        self.state.tensor_fps, self.state.version = self.new_fps, self.delta.version
        self.state.manifests = (self.chain[-1].sha256,)

    async def rollback(self) -> None:
        """Failed after a write: every rank restores the exact old bits (a no-op where nothing is pending)."""
        check_replies(await self.ranks.call("rollback"))

    async def finish(self) -> None:
        """Committed: reset the caches the old weights filled and set the weight version label. A failure
        here is logged, not reported as a failed update: the weights are committed."""
        try:
            await self.ranks.after_update(self.delta.version)
        except Exception:  # noqa: BLE001
            log.exception("engine_ext: v%s applied, but resetting caches / setting the weight version failed", self.delta.version)

    # ---- answer
    def answer(self, noop: bool = False) -> UpdateAnswer:
        self.phases["total"] = time.perf_counter() - self._t0
        d = self.delta
        if noop:
            return UpdateAnswer(
                version=self.state.version, base_version=self.base_version,
                fingerprint=fpr.fmt(self.state.model_fingerprint), tensors=0, elements=0, written=0, payload_bytes=0,
                manifests=[], fallback=[], pause_mode=self.request.pause_mode, pause_ms=0.0,
                phases_ms={k: _ms(v) for k, v in self.phases.items()}, noop=True)
        return UpdateAnswer(
            version=d.version, base_version=self.base_version, fingerprint=fpr.fmt(self.state.model_fingerprint),
            tensors=len({t.name for t in d.tensors}), elements=int(d.nnz), written=int(sum(r.written for r in self.replies)),
            payload_bytes=int(d.payload_bytes), manifests=list(d.manifests),
            fallback=sorted({n for r in self.replies for n in r.fallback}), pause_mode=self.request.pause_mode,
            pause_ms=_ms(self.phases.get("pause", 0.0)), phases_ms={k: _ms(v) for k, v in self.phases.items()})

    async def _timed(self, phase: str, awaitable):
        t = time.perf_counter()
        try:
            return await awaitable
        finally:
            self.phases[phase] = time.perf_counter() - t

    def _timed_sync(self, phase: str, fn):
        t = time.perf_counter()
        try:
            return fn()
        finally:
            self.phases[phase] = time.perf_counter() - t


__all__ = ["UpdateTransaction", "ServedState", "Ranks", "ApplyError", "combine_fingerprints", "check_replies"]
