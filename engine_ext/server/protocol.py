"""Typed data between the parts of an update: the request, what a rank answers, the answer.

Ranks live in other processes (vLLM workers, SGLang schedulers) and their replies cross
the engine's own RPC channels, which carry plain data (vLLM's msgpack, SGLang's
pickle envelope): a :class:`RankReply` is sent as :meth:`RankReply.to_wire` (a dict of
JSON types) and read back with :meth:`RankReply.from_wire`, which refuses anything it
does not expect. Everything on either side of the channel is typed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from ..errors import DeltaError
from ..format import fingerprint as fpr

ROUTE = "/update_weights_delta"  # the update route every engine adapter serves (POST: update, GET: status)
PAUSE_MODES = ("keep", "wait", "abort")
MAX_BODY_BYTES = 64 << 10


def short(value, n: int = 120) -> str:
    """``repr(value)``, cut short: error messages never echo a hostile request at length."""
    text = repr(value)
    return text if len(text) <= n else text[:n] + "..."


class RequestError(DeltaError):
    reason, http_status = "bad_request", 400


# --------------------------------------------------------------------------- request


@dataclass(frozen=True)
class UpdateRequest:
    """``POST /update_weights_delta``'s body (and the in-process hooks' arguments)."""

    url: str  # manifest URI or path, or a store root (its LATEST)
    base_version: int | None = None  # refuse (409) unless this is the served version
    pause_mode: str = "keep"  # keep (freeze in-flight requests), wait (drain), abort
    wait: bool = False  # wait for a running update instead of answering 409
    rollback: bool = False  # allow a target older than the served version (else refused)

    @classmethod
    def parse(cls, body: bytes | str | dict) -> UpdateRequest:
        """Validate a body; anything unexpected is a 400 that names the problem."""
        if not isinstance(body, dict):
            if len(body or b"") > MAX_BODY_BYTES:
                raise RequestError(f"body is over {MAX_BODY_BYTES} bytes")
            try:
                body = json.loads(body or b"")
            except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested too deep
                raise RequestError(f"body is not valid JSON: {str(e)[:120]}") from None
        if not isinstance(body, dict):
            raise RequestError('body must be a JSON object like {"url": "<manifest URI or path>"}')
        types = {"url": str, "base_version": int, "pause_mode": str, "wait": bool, "rollback": bool}
        unknown = sorted(set(body) - set(types))
        if unknown:
            raise RequestError(f"unknown field(s) {short(unknown)}; allowed: {sorted(types)}")
        for k, v in body.items():
            want = types[k]
            if v is None and k != "url":
                continue
            if not isinstance(v, want) or (want is int and isinstance(v, bool)):
                raise RequestError(f"field {k!r} must be {want.__name__}, got {type(v).__name__}")
        if not body.get("url"):
            raise RequestError('missing "url" (manifest URI or path)')
        req = cls(**{k: v for k, v in body.items() if v is not None})
        if req.pause_mode not in PAUSE_MODES:
            raise RequestError(f"pause_mode must be one of {PAUSE_MODES}, got {short(req.pause_mode)}")
        return req


# --------------------------------------------------------------------------- rank replies


@dataclass(frozen=True)
class TensorReport:
    """One tensor's fingerprint as one rank sees it: over the ``covered`` of ``numel`` elements it holds."""

    fingerprint: int
    covered: int
    numel: int

    @property
    def whole(self) -> bool:
        return self.covered == self.numel

    def to_wire(self) -> list:
        return [fpr.fmt(self.fingerprint), self.covered, self.numel]

    @classmethod
    def from_wire(cls, w) -> TensorReport:
        if not (isinstance(w, list) and len(w) == 3 and all(isinstance(x, int) for x in w[1:])):
            raise ValueError(f"bad tensor report {w!r}")
        return cls(fpr.parse(w[0]), w[1], w[2])


@dataclass(frozen=True)
class RankReply:
    """What one rank answers to an op. ``ok=False`` carries ``error`` and ``reason``; the
    other fields are filled by the ops that produce them (see :mod:`engine_ext.server.rank`)."""

    ok: bool
    rank: int
    error: str | None = None
    reason: str | None = None
    fingerprints: dict[str, TensorReport] = field(default_factory=dict)  # setup, resync, apply (the tensors it touched)
    tensors: dict[str, tuple[tuple[int, ...], str]] = field(
        default_factory=dict
    )  # setup: checkpoint name -> (shape, dtype)
    fallback: tuple[str, ...] = ()  # setup, apply: tensors reloaded densely through the engine's loader
    converted: tuple[str, ...] = ()  # setup: tensors mapped through a converting map
    mismatched: tuple[str, ...] = ()  # setup: tensors whose live weights differ from the loaded checkpoint
    unreproducible: dict[str, str] = field(
        default_factory=dict
    )  # setup: {tensor: why} no refresh keeps its copies in step
    tied: dict[str, str] = field(
        default_factory=dict
    )  # setup: checkpoint tensors not served, tied to another {name: kept}
    ties: dict[str, str] = field(
        default_factory=dict
    )  # setup: parameters the engine registers under two names {second: first}
    engine: dict = field(default_factory=dict)  # setup: the engine's kernels/paths on this rank
    derived: dict = field(default_factory=dict)  # audit: {"checked", "opaque", "stale"} of the engine's derived copies
    cold: dict = field(
        default_factory=dict
    )  # cold_audit: the served model against a cold instance (engines/vllm/cold_audit.py)
    written: int = 0  # apply: checkpoint elements written
    undo_bytes: int = 0  # apply
    seconds: dict[str, float] = field(default_factory=dict)  # setup, apply: time per step on the rank
    version: int | None = None  # the committed state the rank carries (setup, commit, status, resync, set_label):
    manifest: str | None = None  # SHA-256 of the manifest of the served version
    commits: int = 0  # commits and resyncs so far
    label: str | None = None  # the caller's name for the served version
    pending: bool = False  # status: an apply is neither committed nor rolled back; fetched: still fetching
    fetched_bytes: int = 0  # fetched: bytes this rank read from the store
    http_status: int | None = None  # a failure's status when it is a DeltaError (422 corrupt, 504 deadline...)

    def to_wire(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["fingerprints"] = {n: r.to_wire() for n, r in self.fingerprints.items()}
        out["tensors"] = {n: [list(s), d] for n, (s, d) in self.tensors.items()}
        out["fallback"], out["converted"], out["mismatched"] = (
            list(self.fallback),
            list(self.converted),
            list(self.mismatched),
        )
        return out

    @classmethod
    def from_wire(cls, w: dict) -> RankReply:
        if not isinstance(w, dict) or not isinstance(w.get("ok"), bool):
            raise ValueError(f"bad rank reply {w!r:.200}")
        names = {f.name for f in fields(cls)}
        unknown = set(w) - names
        if unknown:
            raise ValueError(f"rank reply has unknown fields {sorted(unknown)}")
        kw = dict(w)
        kw["fingerprints"] = {n: TensorReport.from_wire(r) for n, r in w.get("fingerprints", {}).items()}
        kw["tensors"] = {n: (tuple(s), d) for n, (s, d) in w.get("tensors", {}).items()}
        kw["fallback"], kw["converted"] = tuple(w.get("fallback", ())), tuple(w.get("converted", ()))
        kw["mismatched"] = tuple(w.get("mismatched", ()))
        return cls(**kw)

    @classmethod
    def failure(cls, rank: int, e: BaseException) -> RankReply:
        status = e.http_status if isinstance(e, DeltaError) else None
        return cls(
            False,
            rank,
            error=f"{type(e).__name__}: {str(e)[:1000]}",
            reason=getattr(e, "reason", "apply"),
            http_status=status,
        )


# --------------------------------------------------------------------------- answers


@dataclass
class UpdateAnswer:
    """The 200 answer of an update (JSON via :meth:`to_json`). ``noop``: the target is the
    version already served (a replay); nothing was fetched or written."""

    version: int
    base_version: int | None
    fingerprint: str
    tensors: int  # tensors the delta changes
    elements: int  # changed elements in the manifests of the route
    written: int  # checkpoint elements the ranks wrote (counted once per element)
    payload_bytes: int  # the route's blobs, in all
    manifests: list[str]
    fallback: list[str]
    pause_mode: str
    pause_ms: float
    phases_ms: dict[str, float]
    fetched_bytes: list[int] = field(default_factory=list)  # per rank: what each read from the store
    noop: bool = False
    ok: bool = True

    def to_json(self) -> dict:
        return asdict(self)


__all__ = ["PAUSE_MODES", "ROUTE", "RankReply", "RequestError", "TensorReport", "UpdateAnswer", "UpdateRequest"]
