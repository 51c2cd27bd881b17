"""The signed LATEST pointer: the newest complete version of a store (docs/FORMAT.md, "LATEST")."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from ..errors import ManifestError
from .manifest import _FP_RE, _KEY_RE, _SHA_RE, _is_int

LATEST_KEY = "LATEST"
MAX_LATEST_BYTES = 16 << 10


@dataclass
class Latest:
    """The LATEST pointer: the newest complete version, its manifest (key and SHA-256), the
    newest anchor, and until when the pointer may be trusted (a signed pointer that stops
    being refreshed goes stale: TUF's freeze protection)."""

    version: int
    manifest: str
    fingerprint: str
    anchor_version: int | None = None
    sha256: str | None = None  # of the manifest's bytes
    expires_unix: float | None = None

    def signed_bytes(self) -> bytes:
        """What the pointer's signatures cover (canonical JSON of its fields)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def to_json(self, signatures: list | None = None) -> bytes:
        return json.dumps({"signed": asdict(self), "signatures": signatures or []}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> tuple[Latest, list]:
        """(pointer, signatures); a format-1 pointer (a bare object) has no signatures."""
        if len(data) > MAX_LATEST_BYTES:
            raise ManifestError(f"LATEST is {len(data)} bytes, over the {MAX_LATEST_BYTES} limit")
        try:
            d = json.loads(data)
            if isinstance(d, dict) and "signed" in d:
                if set(d) != {"signed", "signatures"} or not isinstance(d["signatures"], list):
                    raise ValueError("unexpected fields")
                lt, sigs = cls(**d["signed"]), d["signatures"]
            else:
                lt, sigs = cls(**d), []
        except (ValueError, TypeError, UnicodeDecodeError, RecursionError) as e:
            raise ManifestError(f"bad LATEST pointer: {type(e).__name__}: {str(e)[:200]}") from None
        if (
            not _is_int(lt.version)
            or lt.version < 0
            or not isinstance(lt.manifest, str)
            or not _KEY_RE.fullmatch(lt.manifest)
            or lt.manifest.startswith(".")
            or (lt.sha256 is not None and not (isinstance(lt.sha256, str) and _SHA_RE.fullmatch(lt.sha256)))
            or not (isinstance(lt.fingerprint, str) and _FP_RE.fullmatch(lt.fingerprint))
            or (
                lt.anchor_version is not None
                and not (_is_int(lt.anchor_version) and 0 <= lt.anchor_version <= lt.version)
            )
            or (
                lt.expires_unix is not None
                and not (
                    isinstance(lt.expires_unix, (int, float))  # NaN, inf: never stale
                    and not isinstance(lt.expires_unix, bool)
                    and math.isfinite(lt.expires_unix)
                )
            )
        ):
            raise ManifestError("bad LATEST pointer: a field is malformed")
        return lt, sigs
