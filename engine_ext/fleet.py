"""Push mode: take N replicas to one version at once, and say which did not get there.

``Fleet(urls).update(uri)`` (and ``engine-ext push URI --servers ...``) POSTs the same
update to every replica's ``/update_weights_delta`` concurrently, each replica
planning its own route from the version it serves (a lagging one catches up through a
chain or an anchor). Transient failures (no connection, a timeout, 409 busy, 429 queue
full, 502/503/504) are retried with exponential backoff and jitter; refusals (a bad
signature, a version of another model or dtype, a downgrade, a failed apply: every
replica rolled back) are not, since the same request would be refused again. The result is one :class:`ReplicaResult` per
replica: version before and after, pause, bytes fetched, attempts, and why it failed.
"""

from __future__ import annotations

import random
import re
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field

import requests

from .server.protocol import ROUTE

TRANSIENT_STATUS = (409, 429, 502, 503, 504)
# 409s that the same request gets again, whatever the replica does meanwhile: not retried.
FINAL_REASONS = frozenset({"model_mismatch", "downgrade"})
_VERSION_KEY = re.compile(r"v(\d{8})(?:\.anchor)?\.json$")


class WeightSyncError(RuntimeError):
    """A sync did not bring every replica to the trainer's version (those that failed keep serving what they had)."""


def publish_committed(publisher, model, version: int | None = None, *, holders: str = "replicas") -> str:
    """Publish this rank's ``model`` with a (sharded) publisher and wait until its part is stored; the uri.
    On every rank, a version some rank failed raises :class:`WeightSyncError` (nothing was committed: the
    ``holders`` keep the last committed version, and the next one is an anchor)."""
    uri = publisher.publish(model, version)
    publisher.wait()
    if publisher.version in publisher.aborted:
        raise WeightSyncError(
            f"v{publisher.version} was not published (nothing committed; the {holders} keep the last "
            f"committed version): {publisher.aborted[publisher.version]}"
        )
    return uri


@dataclass
class ReplicaResult:
    """One replica's outcome. ``ok``: it answered 200 with the fleet's target version."""

    url: str
    ok: bool = False
    version_before: int | None = None
    version_after: int | None = None
    fingerprint: str | None = None  # of the weights it serves after the update
    pause_ms: float | None = None
    fetched_bytes: int | None = None  # all its ranks together
    attempts: int = 0
    status: int | None = None  # the last HTTP status (None: no answer)
    error: str | None = None
    seconds: float = 0.0


@dataclass
class FleetResult:
    uri: str
    target: int | None  # the version every replica must reach (None: nobody answered and the URI does not say)
    replicas: list[ReplicaResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.replicas) and all(r.ok for r in self.replicas)

    @property
    def failed(self) -> list[ReplicaResult]:
        return [r for r in self.replicas if not r.ok]

    def table(self) -> str:
        """The per-replica table, plain text."""
        rows = [("replica", "before", "after", "pause ms", "fetched KB", "tries", "status")]
        for r in self.replicas:
            status = "ok" if r.ok else f"FAILED ({r.status or 'no answer'}): {(r.error or '')[:120]}"
            rows.append(
                (
                    r.url,
                    _s(r.version_before),
                    _s(r.version_after),
                    _s(r.pause_ms),
                    "-" if r.fetched_bytes is None else f"{r.fetched_bytes / 1e3:.1f}",
                    str(r.attempts),
                    status,
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows)

    def to_json(self) -> dict:
        return {"uri": self.uri, "target": self.target, "ok": self.ok, "replicas": [asdict(r) for r in self.replicas]}


def _s(x) -> str:
    return "-" if x is None else str(x)


def version_of(uri: str) -> int | None:
    """The version a manifest URI names (``.../v00000007.json`` -> 7); None for a store root (its LATEST)."""
    m = _VERSION_KEY.search(uri.split("?")[0])
    return int(m.group(1)) if m else None


class Fleet:
    """Replicas (server base URLs, e.g. ``http://10.0.0.5:8000``) updated together.

    ``token``: the bearer token of their update routes; ``retries``: extra attempts per
    replica for transient failures, waiting ``backoff_s`` doubled each time (+-50 %);
    ``timeout_s``: one attempt's limit (an update fetches before it answers).
    """

    def __init__(
        self,
        urls,
        token: str | None = None,
        *,
        retries: int = 4,
        backoff_s: float = 1.0,
        timeout_s: float = 900.0,
        session: requests.Session | None = None,
    ):
        self.urls = [u.rstrip("/") for u in urls]
        if not self.urls:
            raise ValueError("no replicas given")
        self.token, self.retries, self.backoff_s, self.timeout_s = token, retries, backoff_s, timeout_s
        self.session = session or requests.Session()

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def status(self, url: str) -> dict | None:
        """A replica's ``GET /update_weights_delta``, or None when it does not answer."""
        try:
            r = self.session.get(url + ROUTE, headers=self._headers(), timeout=30)
            return r.json() if r.status_code == 200 else None
        except (requests.RequestException, ValueError):
            return None

    def update_one(self, url: str, body: dict) -> ReplicaResult:
        """POST the update to one replica, retrying transient failures; never raises."""
        res, t0 = ReplicaResult(url), time.perf_counter()
        st = self.status(url)
        res.version_before = st.get("version") if st else None
        for attempt in range(self.retries + 1):
            res.attempts = attempt + 1
            try:
                r = self.session.post(url + ROUTE, json=body, headers=self._headers(), timeout=self.timeout_s)
                res.status = r.status_code
                try:
                    answer = r.json()
                except ValueError:
                    answer = {"error": r.text[:300]}
                if r.status_code == 200:
                    res.ok, res.error = True, None
                    res.version_after, res.pause_ms = answer.get("version"), answer.get("pause_ms")
                    res.fingerprint = answer.get("fingerprint")
                    res.fetched_bytes = sum(answer.get("fetched_bytes") or [])
                    break
                res.error = f"{answer.get('reason', '')}: {answer.get('error', '')}".strip(": ")
                if r.status_code not in TRANSIENT_STATUS or answer.get("reason") in FINAL_REASONS:
                    break
            except requests.RequestException as e:
                res.status, res.error = None, f"{type(e).__name__}: {str(e)[:300]}"
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2**attempt * random.uniform(0.5, 1.5))
        if not res.ok:
            st = self.status(url)
            res.version_after = st.get("version") if st else None
        res.seconds = time.perf_counter() - t0
        return res

    def update(self, uri: str, *, rollback: bool = False, progress: bool = False) -> FleetResult:
        """Every replica to the version at ``uri`` (a manifest, or a store root: its LATEST), concurrently.

        A replica is ``ok`` when it answered 200 with the target version: the one the URI
        names, or for a store root the highest version any replica answered with.
        """
        body = {"url": uri, "wait": True, **({"rollback": True} if rollback else {})}
        results: dict[str, ReplicaResult] = {}
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(self.urls), desc=f"push {uri.rsplit('/', 1)[-1] or uri}", unit="replica")
        with ThreadPoolExecutor(min(64, len(self.urls))) as pool:
            futures = {pool.submit(self.update_one, u, body): u for u in self.urls}
            for f in as_completed(futures):
                r = f.result()
                results[r.url] = r
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(failed=sum(not x.ok for x in results.values()))
        if bar is not None:
            bar.close()
        replicas = [results[u] for u in self.urls]
        target = version_of(uri)
        if target is None:
            answered = [r.version_after for r in replicas if r.ok and r.version_after is not None]
            target = max(answered) if answered else None
        for r in replicas:
            if r.ok and r.version_after != target:
                r.ok, r.error = False, f"answered version {r.version_after}, not {target}"
        return FleetResult(uri, target, replicas)

    def bring(self, uri: str, fingerprint: str, names: dict[str, str] | None = None) -> FleetResult:
        """:meth:`update`, then insist: every replica answered 200 with the target version and serves
        ``fingerprint`` (the trainer's, ``fpr.fmt`` form); else :class:`WeightSyncError` naming each
        replica that did not (``names``: how to call a URL in that message), and why."""
        result = self.update(uri)
        name = (names or {}).get
        if not result.ok:
            raise WeightSyncError(
                f"{len(result.failed)} of {len(result.replicas)} server(s) did not reach "
                f"v{result.target}: " + "; ".join(f"{name(r.url, r.url)}: {r.error}" for r in result.failed)
            )
        wrong = [name(r.url, r.url) for r in result.replicas if r.fingerprint != fingerprint]
        if wrong:
            raise WeightSyncError(
                f"{wrong} serve v{result.target} with another fingerprint than the trainer's {fingerprint}"
            )
        return result


__all__ = ["TRANSIENT_STATUS", "Fleet", "FleetResult", "ReplicaResult", "WeightSyncError", "version_of"]
