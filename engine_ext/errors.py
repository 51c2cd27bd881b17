"""Errors with a reason callers can map to an HTTP status or an exit message.

Every reason is snake_case (``^[a-z][a-z0-9_]*$``): it is a metrics label and a JSON value, and
:meth:`UpdateRefused.find` reads it back out of a message. tests/test_errors.py checks every class.
"""

import re

# The classes are declarations, alike in shape on purpose (the `duplicates` tool pairs them): each is a
# reason, a status and a docstring saying when, and callers catch them by class; a table would lose both.


class DeltaError(Exception):
    """Base class. ``reason`` is a short machine-readable label (metrics, JSON answers)."""

    reason = "error"
    http_status = 500


class SourceError(DeltaError):
    """The store could not be read (missing object, network failure, refused source)."""

    reason = "fetch"
    http_status = 502


class NotFoundError(SourceError):
    reason = "not_found"
    http_status = 404


class ForbiddenSourceError(SourceError):
    reason = "forbidden_source"
    http_status = 403


class FetchTimeoutError(SourceError):
    """The update's fetch deadline passed (a slow or trickling source)."""

    reason = "fetch_timeout"
    http_status = 504


class ConflictError(SourceError):
    """An object that is written once already exists (a version's manifest, signature or blob:
    another publisher took that version), or LATEST moved past the version being published."""

    reason = "conflict"
    http_status = 409


class ManifestError(DeltaError):
    """The manifest is malformed, of an unknown format version, or exceeds limits."""

    reason = "bad_manifest"
    http_status = 400


class IntegrityError(DeltaError):
    """A blob's size or SHA-256 does not match, or its content does not decode cleanly."""

    reason = "integrity"
    http_status = 422


class PartlyHeldError(DeltaError):
    """This rank holds only some elements of a box it was asked for (its shard cuts the box)."""

    reason = "partly_held"
    http_status = 422


class BaseMismatchError(DeltaError):
    """The delta applies to another version/fingerprint than the one held."""

    reason = "base_mismatch"
    http_status = 409


class ModelMismatchError(DeltaError):
    """The version holds a tensor the served model does not (or with another shape or dtype):
    it was published from another model or layout, or in another dtype. Not a wrong base:
    no route from any base would make it apply."""

    reason = "model_mismatch"
    http_status = 409


class UnreproducibleError(DeltaError):
    """The update writes a tensor whose served form this server cannot bring to what a cold start on the
    new weights would compute with (its live weights differ from the checkpoint they were loaded from: a
    layout the engine derives after loading that no refresh follows). Refused before anything is written;
    the server named those tensors at start-up. Restart the server on the new checkpoint instead."""

    reason = "unreproducible"
    http_status = 409


class UnsupportedError(DeltaError):
    """This server cannot update its model in place at all (a model, layout or engine set-up that engine_ext
    does not support: quantised layers on vLLM's CPU, a tensor the layout probe cannot map with no checkpoint
    to read it from, SGLang with data or pipeline parallelism...). Generation goes on; every update is refused."""

    reason = "unsupported"
    http_status = 503


class Busy(DeltaError):
    """Another update is being applied, and this request did not ask to queue behind it. Retry."""

    reason = "busy"
    http_status = 409


class QueueFull(DeltaError):
    """Too many updates (or a rank's fetches) are waiting already."""

    reason = "queue_full"
    http_status = 429


class OutOfOrderError(DeltaError):
    """A rank was asked for a step out of the transaction's order: an apply while another is neither
    committed nor rolled back, an apply with nothing fetched for it, an undo log used twice. Another
    driver reached the rank in between, or a driver lost its place; nothing was written."""

    reason = "out_of_order"
    http_status = 409


class ApplyError(DeltaError):
    """A rank failed (kernel error, unknown tensor, loader failure, a refresh of a derived copy); the
    transaction rolls every rank back. Also what a rank's refusal becomes on the driver, with the
    refusal's own reason and status (:func:`engine_ext.server.transaction.check_replies`)."""

    reason = "apply"
    http_status = 500


class VerifyError(DeltaError):
    """The result of an apply does not have the fingerprint the manifest promises."""

    reason = "verify"
    http_status = 500


class RollbackError(DeltaError):
    """A rank could not restore every tensor of a failed apply (the engine's loader raised on the old value): the
    served bits of those tensors are unknown until a resync or a reload."""

    reason = "rollback"
    http_status = 500


class AuditUnavailable(DeltaError):
    """A cold-load audit this server does not answer: turned off (``ENGINE_EXT_COLD_AUDIT``), not built by
    this engine's adapter, or asked while an apply is pending."""

    reason = "audit_unavailable"
    http_status = 409


class UpdateRefused(DeltaError):
    """An update's refusal, carried where only text survives: a vLLM worker's exception reaches the
    caller of ``LLM.update_weights`` as a message, and vLLM's HTTP weight-sync client keeps only
    the status and body. The reason and status ride in the message's head, where :meth:`find`
    reads them back (``engine_ext refused [409 base_mismatch]: ...``)."""

    HEAD = "engine_ext refused"

    def __init__(self, reason: str, http_status: int, error: str):
        self.reason, self.http_status, self.error = reason, int(http_status), error
        super().__init__(f"{self.HEAD} [{self.http_status} {reason}]: {error}")

    @classmethod
    def of(cls, e: BaseException) -> "UpdateRefused":
        """``e`` as a refusal: a DeltaError keeps its reason and status; anything else is a 500 ``internal``."""
        if isinstance(e, UpdateRefused):
            return e
        if isinstance(e, DeltaError):
            return cls(e.reason, e.http_status, str(e))
        return cls("internal", 500, f"{type(e).__name__}: {e}")

    @classmethod
    def find(cls, text: str) -> "UpdateRefused | None":
        """The refusal whose message ``text`` contains (wrapped by other errors' text), or None."""
        m = re.search(re.escape(cls.HEAD) + r" \[(\d{3}) ([A-Za-z0-9_.-]+)\]: ", text or "")
        if m is None:
            return None
        return cls(m.group(2), int(m.group(1)), text[m.end() :].strip())
