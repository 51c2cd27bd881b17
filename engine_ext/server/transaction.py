"""One update of the served weights, all ranks or none: the transaction every entry point runs.

The HTTP routes on vLLM and SGLang (``/update_weights_delta``, and vLLM's own weight-transfer
routes when its backend is ours), the in-process SGLang ``Engine`` hook and vLLM's
``engine_ext`` weight-transfer backend all drive the same :class:`UpdateTransaction` from
one place (the *driver*: the API server process, SGLang's TokenizerManager, or rank 0
of the in-process engine). They differ only in how the driver reaches the ranks, the
small :class:`Ranks` protocol each engine adapter implements. The lifecycle, in order
(docs/TRANSACTION.md draws it):

1. :meth:`UpdateTransaction.plan`: signed manifests only; the route from the served version.
2. :meth:`UpdateTransaction.fetch`: every rank fetches, verifies and decodes its own part of
   the route straight from the store (the driver never reads a blob).
3. :meth:`UpdateTransaction.apply`: paused; every rank writes in place with undo.
4. :meth:`UpdateTransaction.verify`: per-rank fingerprints combined and checked.
5. :meth:`UpdateTransaction.commit` or :meth:`UpdateTransaction.rollback`: everywhere.
6. :meth:`UpdateTransaction.finish`: caches reset, version label set, resumed.
7. :meth:`UpdateTransaction.release`: whatever a rank fetched and did not apply is dropped.

Steps 1-2 (:meth:`UpdateTransaction.prepare`) run while the engine serves and other
updates run; steps 3-6 (:meth:`UpdateTransaction.execute`) run under the driver's
update lock, only if the served state is still the one step 1 planned from. A
:class:`ServedState` is what the driver knows about the served weights; only a commit
changes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from .. import settings
from ..errors import ApplyError, BaseMismatchError, FetchTimeoutError, UnreproducibleError, VerifyError
from ..format import fingerprint as fpr
from ..format.manifest import ANCHOR
from ..store import reader, route
from ..store.signing import Trust
from .protocol import RankReply, UpdateAnswer, UpdateRequest

log = logging.getLogger("engine_ext")


# --------------------------------------------------------------------------- reaching the ranks


class Ranks(Protocol):
    """How a driver reaches every rank of one engine (one implementation per engine and entry point)."""

    async def call(self, op: str, **kwargs) -> list[RankReply]:
        """Run ``op`` of :class:`engine_ext.server.rank.RankUpdater` on every rank; one reply each, in rank order."""

    async def pause(self, mode: str) -> None:
        """Stop generation steps so no forward pass reads weights mid-write (``keep``, ``wait`` or ``abort``)."""

    async def resume(self) -> None:
        """Let generation continue (always called after :meth:`pause`, whatever happened)."""

    async def after_update(self, version: int) -> None:
        """Drop caches computed with the old weights (prefix/radix KV) and set the engine's weight version label."""


def check_replies(replies: list[RankReply]) -> list[RankReply]:
    """The replies, or :class:`ApplyError` naming every rank that failed and why (with the reason
    and status of the first failure that was a refusal, e.g. a corrupt blob a rank fetched: 422)."""
    failed = [r for r in replies if not r.ok]
    if failed:
        e = ApplyError("; ".join(f"rank {r.rank}: {r.error}" for r in failed))
        refused = next((r for r in failed if r.http_status), None)
        if refused is not None:
            e.reason, e.http_status = refused.reason, refused.http_status
        raise e
    return replies


@dataclass(frozen=True)
class CommittedState:
    """What every rank carries of the updates committed on it."""

    commits: int  # updates committed since start-up
    version: int | None  # the last one's version
    manifest: str | None  # its manifest's SHA-256
    label: str | None  # the engine's weight-version label


def committed_state(replies: list[RankReply]) -> CommittedState:
    """The :class:`CommittedState` every rank carries; :class:`ApplyError` when the ranks disagree (a
    commit reached only some of them: no update can be planned safely)."""
    seen = {CommittedState(r.commits, r.version, r.manifest, r.label) for r in replies}
    if len(seen) != 1:
        raise ApplyError(
            "the ranks carry different committed states (a commit reached only some of them): "
            + "; ".join(f"rank {r.rank}: commit {r.commits}, v{r.version}" for r in replies)
        )
    return seen.pop()


def combine_fingerprints(replies: list[RankReply], names=None) -> dict[str, int]:
    """The whole-tensor fingerprints from every rank's :class:`~engine_ext.server.protocol.TensorReport`.

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
        if covered == 0 < numel:
            raise VerifyError(
                f"{name}: the engine's loader writes none of this checkpoint tensor on any rank: the engine "
                "ignores it (a checkpoint layout it does not load, e.g. fused experts on SGLang 0.5.23)"
            )
        if covered != numel:
            raise VerifyError(
                f"{name}: ranks cover {covered} of {numel} elements (overlapping or missing shards), cannot verify"
            )
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
    commits: int = 0  # the ranks' commit count this state describes (:func:`committed_state`)
    label: str | None = None  # the caller's name for the served version (vLLM's weight version)

    def key(self) -> tuple:
        """What a planned route depends on: changes only when an update commits."""
        return self.version, self.model_fingerprint, self.manifests, self.commits

    @classmethod
    def from_setup(cls, replies: list[RankReply], version: int | None) -> ServedState:
        """The served state from every rank's ``setup`` (or ``resync``) reply: the live fingerprints, and
        the committed state the ranks carry; ``version`` (the configured start version) only where no
        commit happened yet. A checkpoint tensor that some rank's engine ties to another and loads
        nowhere (a tied ``lm_head.weight`` that the checkpoint also stores) is not part of it: versions
        carry the kept tensor only."""
        check_replies(replies)
        tied = {n: k for r in replies for n, k in r.tied.items()}
        layout = {
            "fallback": sorted({n for r in replies for n in r.fallback}),
            "converted": sorted({n for r in replies for n in r.converted}),
            "mismatched": sorted({n for r in replies for n in r.mismatched}),
            "unreproducible": dict(sorted({n: why for r in replies for n, why in r.unreproducible.items()}.items())),
            "tied": dict(sorted(tied.items())),
            # every tie of the served model (a trainer whose gathered stream carries both names leaves
            # the second out: engine_ext.integrations.verl), whether or not the checkpoint stores the copy
            "ties": dict(sorted({n: k for r in replies for n, k in r.ties.items()}.items())),
            "engine": [r.engine for r in replies],
        }
        if tied:
            log.info(
                "engine_ext: not served on their own, tied by the engine to another tensor: %s",
                ", ".join(f"{n} (= {k})" for n, k in sorted(tied.items())),
            )
        names = sorted({n for r in replies for n in r.fingerprints} - set(tied))
        tensors = {n: s for n, s in replies[0].tensors.items() if n not in tied}
        state = cls(version, combine_fingerprints(replies, names), tensors, layout)
        committed = committed_state(replies)
        if committed.commits:
            state.version = committed.version
            state.manifests = (committed.manifest,) if committed.manifest else ()
        state.commits = committed.commits
        state.label = committed.label
        return state

    @property
    def model_fingerprint(self) -> int:
        return fpr.model_fingerprint(self.tensor_fps)


# --------------------------------------------------------------------------- the transaction


def _ms(s: float) -> float:
    return round(s * 1000, 3)


class UpdateTransaction:
    """Take the served weights from ``state`` to the version at ``source``, on every rank or none.

    ``source`` is the request's URL after the allow-list check. :meth:`prepare` then
    :meth:`execute`, and :meth:`release` in any case (or :meth:`run`, all three) perform
    the steps in order; each records its time in :attr:`phases` (seconds).
    """

    POLL_S = 0.05  # between asking the ranks whether their fetch is done (each ask is one cheap RPC)

    def __init__(
        self,
        ranks: Ranks,
        state: ServedState,
        request: UpdateRequest,
        source: str,
        trust: Trust | None = None,
        deadline: float | None = None,
    ):
        self.ranks, self.state, self.request, self.source = ranks, state, request, source
        self.trust = trust or Trust.from_settings()
        self.id = uuid.uuid4().hex
        self.phases: dict[str, float] = {}
        self.planned_from: tuple | None = None
        self.store = None
        self.limits = route.Limits()
        self.chain: list[reader.Link] = []
        self.target: reader.Link | None = None  # the target version's manifest (set by plan)
        self.fetched_bytes: list[int] = []  # per rank
        self.replies: list[RankReply] = []
        self.new_fps: dict[str, int] = {}
        self.base_version = state.version
        self._fetching = False
        self._t0 = time.perf_counter()
        # One fetch deadline (``time.monotonic()``) for the whole update: every manifest and blob, plan and
        # fetch, and every plan again after others committed meanwhile (the driver passes the request's own)
        self.fetch_timeout = settings.current().fetch_timeout
        self.deadline = deadline if deadline is not None else time.monotonic() + self.fetch_timeout

    async def run(self) -> UpdateAnswer:
        try:
            await self.prepare()
            return await self.execute()
        finally:
            await self.release()

    async def prepare(self) -> None:
        """Steps 1-2, while the engine serves: plan, then every rank fetches its part (nothing
        to fetch when the target is already served)."""
        self.planned_from = self.state.key()
        await self._timed("plan", asyncio.to_thread(self.plan))
        if self.chain:
            await self._timed("fetch", self.fetch())

    async def execute(self) -> UpdateAnswer:
        """Steps 3-6 on every rank; call with the driver's update lock held, on the state
        :meth:`prepare` planned from (BaseMismatchError otherwise)."""
        if self.state.key() != self.planned_from:
            raise BaseMismatchError("the served weights changed while this update was being fetched")
        if not self.chain:
            if self.target is not None and self.target.manifest.version != self.state.version:
                await self._timed("adopt", self.adopt())
            return self.answer(noop=True)
        t_pause = time.perf_counter()
        await self._timed("pause_enter", self.ranks.pause(self.request.pause_mode))
        try:
            await self._timed("apply", self.apply())
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
        request says ``rollback``), a tensor the served model does not hold with that shape
        and dtype, or a decode over the model's budget. An empty route: the target is what is
        served (a replay)."""
        if self.request.base_version is not None and self.request.base_version != self.state.version:
            raise BaseMismatchError(
                f"request expects base version {self.request.base_version}, server holds {self.state.version}"
            )
        self.limits = route.Limits.for_model(self.state.tensors)
        planned = route.plan(
            self.source,
            self.state.version,
            self.state.model_fingerprint,
            have_manifests=self.state.manifests,
            trust=self.trust,
            limits=self.limits,
            allow_older=self.request.rollback,
            deadline=self.deadline,
            tensor_fps=self.state.tensor_fps,
            expected=self.state.tensors,
        )
        self.store, self.chain, self.target = planned.store, planned.links, planned.target
        if not self.chain:
            self._check_manifests([self.target])  # a target adopted without a fetch is held to the same rules
            return
        first = self.chain[0].manifest
        if first.kind != ANCHOR:
            base_fp = fpr.parse(first.base_fingerprint)
            if base_fp != self.state.model_fingerprint or (
                self.state.version is not None and first.base_version != self.state.version
            ):
                raise BaseMismatchError(
                    f"v{first.version} applies to version {first.base_version} (fingerprint {first.base_fingerprint}); "
                    f"server holds version {self.state.version} (fingerprint {fpr.fmt(self.state.model_fingerprint)})"
                    f"{route.differing_tensors(first, self.state.tensor_fps)}"
                )
        self._check_manifests(self.chain)
        layout, written = self.state.layout, self.written()
        if refused := sorted(set(layout.get("mismatched", ())) & written):
            raise UnreproducibleError(
                f"the route writes {len(refused)} tensor(s) whose served weights differ from the checkpoint they were "
                f"loaded from (named at start-up: a layout the engine derives after loading, which an in-place write "
                f"would not reproduce): {refused[:8]}"
            )
        if refused := sorted(set(layout.get("unreproducible", {})) & written):
            why = layout["unreproducible"][refused[0]]
            raise UnreproducibleError(
                f"the route writes {len(refused)} tensor(s) whose engine keeps copies derived after loading that no "
                f"refresh keeps in step (named at start-up), e.g. {refused[0]}: {why}; all: {refused[:8]}"
            )

    def written(self) -> set[str]:
        """Tensors some link of the route writes: an anchor's every tensor, a delta's changed ones."""
        written: set[str] = set()
        for link in self.chain:
            c = link.manifest.columns()
            written.update(c.names if link.manifest.kind == ANCHOR else c.changed())
        return written

    def _check_manifests(self, links) -> None:
        for link in links:
            reader.check_expected(link.manifest, self.state.tensors, self.store.key_uri(link.key))
            reader.check_decode_budget(link.manifest, self.limits.decoded_bytes)

    async def fetch(self) -> None:
        """While the engine still serves, outside the update lock, before the fetch deadline: send
        every rank the route (manifest keys and the SHA-256 of the bytes the driver verified);
        each reads those manifests from the store, checks them against the SHA-256, fetches
        only the tensors (or grid cells, :mod:`engine_ext.format.chunks`) it holds, checks every part's SHA-256,
        decodes (bounded by the manifests' counts) and composes a chain, in the background,
        while the driver polls. Any rank's failure fails the update before anything is written."""
        links = [
            {"key": link.key, "sha256": link.sha256, "max_bytes": self.limits.manifest_bytes} for link in self.chain
        ]
        self._fetching = True
        check_replies(
            await self.ranks.call(
                "fetch",
                txn=self.id,
                store=self.store.uri,
                route=links,
                timeout_s=max(0.0, self.deadline - time.monotonic()),
            )
        )
        while True:
            replies = check_replies(await self.ranks.call("fetched", txn=self.id))
            if not any(r.pending for r in replies):
                break
            if time.monotonic() > self.deadline:
                raise FetchTimeoutError(
                    f"the ranks did not fetch their part within {self.fetch_timeout:g} s (ENGINE_EXT_FETCH_TIMEOUT)"
                )
            await asyncio.sleep(self.POLL_S)
        self.fetched_bytes = [r.fetched_bytes for r in replies]

    async def apply(self) -> None:
        """Paused: every rank writes its fetched part in place and keeps an undo log; any rank's
        failure rolls every rank back (ranks that did not fail hold a pending apply)."""
        self.replies = await self.ranks.call("apply", txn=self.id, commits=self.state.commits)
        try:
            check_replies(self.replies)
            self._fetching = False  # every rank took its part: nothing left to release
        except BaseException:
            await self._timed("rollback", self.rollback())
            raise

    def changed(self) -> list[str]:
        """Tensors the route changes (every tensor for a route through an anchor)."""
        if any(link.manifest.kind == ANCHOR for link in self.chain):
            return list(self.chain[-1].manifest.columns().names)
        return sorted({name for link in self.chain for name in link.manifest.columns().changed()})

    def verify(self) -> None:
        """Paused, after every rank applied: the fingerprints combined over ranks must equal every
        per-tensor fingerprint and the model fingerprint the last manifest promises (a wrong base,
        a misapplied element or a rank that missed its part shows here)."""
        last = self.chain[-1].manifest
        c = last.columns()
        want = dict(zip(c.names, c.fingerprint.tolist()))
        got = combine_fingerprints(self.replies, self.changed())
        bad = [f"{n}: {fpr.fmt(f)} != {fpr.fmt(want[n])}" for n, f in got.items() if f != want[n]]
        if bad:
            raise VerifyError(
                f"fingerprint mismatch after apply in {len(bad)} tensor(s), rolled back: " + "; ".join(bad[:5])
            )
        new = dict(self.state.tensor_fps) | got
        if fpr.model_fingerprint(new) != fpr.parse(last.fingerprint):
            raise VerifyError(
                f"model fingerprint after apply {fpr.fmt(fpr.model_fingerprint(new))} != "
                f"manifest's {last.fingerprint}, rolled back"
            )
        self.new_fps = new

    async def commit(self) -> None:
        """Verified: every rank drops its undo log and records the version; the served state moves
        (and remembers the manifest it came from, which the next delta must name as its base: a catch-up
        delta's is the one it stands for)."""
        version, sha = self.chain[-1].manifest.version, route.held_sha(self.chain[-1])
        replies = check_replies(await self.ranks.call("commit", version=version, manifest=sha))
        self.state.tensor_fps, self.state.version = self.new_fps, version
        self.state.manifests = (sha,)
        committed = committed_state(replies)
        self.state.commits = committed.commits
        self.state.label = committed.label

    async def adopt(self) -> None:
        """Under the lock, when the served weights already are the target's (same fingerprint) but
        under another version or none (a server started from the run's first checkpoint): every
        rank records the target's version and the state binds to its manifest; nothing is
        fetched, written or paused."""
        version, sha = self.target.manifest.version, self.target.sha256
        replies = check_replies(await self.ranks.call("commit", version=version, manifest=sha))
        self.state.version, self.state.manifests = version, (sha,)
        committed = committed_state(replies)
        self.state.commits = committed.commits
        self.state.label = committed.label

    async def rollback(self) -> None:
        """Failed after a write: every rank restores the exact old bits (a no-op where nothing is pending)."""
        check_replies(await self.ranks.call("rollback"))

    async def finish(self) -> None:
        """Committed: reset the caches the old weights filled and set the weight version label. A failure
        here is logged, not reported as a failed update: the weights are committed."""
        version = self.chain[-1].manifest.version
        try:
            await self.ranks.after_update(version)
        except Exception:
            log.exception("engine_ext: v%s applied, but resetting caches / setting the weight version failed", version)

    async def release(self) -> None:
        """Last, whatever happened (also when the update was planned again or refused): every rank
        drops what it fetched for this update and did not apply. A failure here is logged only."""
        if not self._fetching:
            return
        self._fetching = False
        try:
            bad = [r for r in await self.ranks.call("discard", txn=self.id) if not r.ok]
            if bad:
                log.warning("engine_ext: dropping fetched parts failed on ranks %s", [r.rank for r in bad])
        except Exception:
            log.exception("engine_ext: dropping fetched parts of update %s failed", self.id)

    # ---- answer
    def answer(self, noop: bool = False) -> UpdateAnswer:
        self.phases["total"] = time.perf_counter() - self._t0
        phases = {k: _ms(v) for k, v in self.phases.items()}
        if noop:
            return UpdateAnswer(
                version=self.state.version,
                base_version=self.base_version,
                fingerprint=fpr.fmt(self.state.model_fingerprint),
                tensors=0,
                elements=0,
                written=0,
                payload_bytes=0,
                manifests=[],
                fallback=[],
                pause_mode=self.request.pause_mode,
                pause_ms=0.0,
                phases_ms=phases,
                noop=True,
            )
        # inside the pause's apply: the slowest rank's check of its derived copies (ENGINE_EXT_VERIFY_DERIVED)
        phases["verify_derived"] = _ms(max((r.seconds.get("verify_derived", 0.0) for r in self.replies), default=0.0))
        return UpdateAnswer(
            version=self.chain[-1].manifest.version,
            base_version=self.base_version,
            fingerprint=fpr.fmt(self.state.model_fingerprint),
            tensors=len(self.changed()),
            elements=sum(int(link.manifest.columns().nnz.sum()) for link in self.chain),
            written=int(sum(r.written for r in self.replies)),
            payload_bytes=sum(link.manifest.payload_bytes for link in self.chain),
            fetched_bytes=self.fetched_bytes,
            manifests=[self.store.key_uri(link.key) for link in self.chain],
            fallback=sorted({n for r in self.replies for n in r.fallback}),
            pause_mode=self.request.pause_mode,
            pause_ms=_ms(self.phases.get("pause", 0.0)),
            phases_ms=phases,
        )

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


__all__ = [
    "ApplyError",
    "Ranks",
    "ServedState",
    "UpdateTransaction",
    "check_replies",
    "combine_fingerprints",
    "committed_state",
]
