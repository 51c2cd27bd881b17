"""Signed versions: Ed25519 signatures over the exact bytes a reader is about to trust.

The publisher signs each manifest's raw bytes (a detached ``<manifest key>.sig`` object,
written before the manifest) and the ``LATEST`` pointer (signature embedded, with an
expiry). A server verifies against the public keys it is configured with
(``ENGINE_EXT_TRUSTED_KEYS``, a threshold of them) *before* parsing anything: the
manifest then vouches, by SHA-256 and size, for every blob, and each delta names its
base manifests by SHA-256. Why Ed25519 signatures on the update stream and not TUF's
role metadata: docs/SECURITY.md.

Unsigned stores are read only where the operator says so explicitly
(``ENGINE_EXT_ALLOW_UNSIGNED=1``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

from .. import settings
from ..errors import IntegrityError

MAX_SIGNATURE_BYTES = 16 << 10
SIG_SUFFIX = ".sig"


class SignatureError(IntegrityError):
    """Unsigned, signed by an untrusted key, or a signature that does not verify."""

    reason = "signature"
    http_status = 403


def key_id(public_raw: bytes) -> str:
    """A key's id: the first 16 hex digits of SHA-256 of its raw 32 bytes."""
    return hashlib.sha256(public_raw).hexdigest()[:16]


def _public_raw(public_key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def generate_key(path: str | os.PathLike) -> str:
    """Write a new Ed25519 private key (PEM, mode 0600) at ``path`` and its public key at
    ``path.pub``; returns the key id."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    with open(f"{path}.pub", "wb") as f:
        f.write(pub)
    return key_id(_public_raw(key.public_key()))


class Signer:
    """Signs with one or more Ed25519 private keys (PEM files or key objects)."""

    def __init__(self, keys):
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        self.keys = []
        for k in keys if isinstance(keys, (list, tuple)) else [keys]:
            if not isinstance(k, Ed25519PrivateKey):
                with open(k, "rb") as f:
                    k = serialization.load_pem_private_key(f.read(), password=None)
                if not isinstance(k, Ed25519PrivateKey):
                    raise ValueError("signing keys must be Ed25519 private keys (engine-ext keygen makes one)")
            self.keys.append(k)
        if not self.keys:
            raise ValueError("a Signer needs at least one key")

    @classmethod
    def from_settings(cls, s: settings.Settings | None = None) -> Signer | None:
        """The signer of ``ENGINE_EXT_SIGNING_KEY`` (comma-separated PEM paths), or None."""
        paths = (s or settings.current()).signing_keys
        return cls(list(paths)) if paths else None

    def public_keys(self) -> list:
        """The public halves of the signing keys (a publisher trusts what it signed itself)."""
        return [k.public_key() for k in self.keys]

    def signatures(self, data: bytes) -> list[dict]:
        return [{"keyid": key_id(_public_raw(k.public_key())), "sig": k.sign(data).hex()} for k in self.keys]

    def sign_detached(self, data: bytes) -> bytes:
        """The ``.sig`` object for ``data``."""
        return json.dumps({"signatures": self.signatures(data)}).encode()

    def sign_file(self, path: str | os.PathLike) -> str:
        """Write ``path.sig`` for a local manifest file (re-signing one written elsewhere); returns its path."""
        with open(path, "rb") as f:
            sig = self.sign_detached(f.read())
        out = f"{os.fspath(path)}{SIG_SUFFIX}"
        with open(out, "wb") as f:
            f.write(sig)
        return out


def canonical(obj: dict) -> bytes:
    """The bytes an embedded signature covers: sorted keys, no spaces."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


@dataclass
class Trust:
    """What a reader accepts: signatures of at least ``threshold`` of ``keys`` (by id), or,
    only when ``allow_unsigned`` is set explicitly, unsigned data."""

    keys: dict = field(default_factory=dict)  # key id -> Ed25519PublicKey
    threshold: int = 1
    allow_unsigned: bool = False

    @classmethod
    def from_settings(cls, s: settings.Settings | None = None) -> Trust:
        s = s or settings.current()
        return cls.from_public_keys(s.trusted_keys, threshold=s.signature_threshold, allow_unsigned=s.allow_unsigned)

    @classmethod
    def from_public_keys(cls, items, threshold: int = 1, allow_unsigned: bool = False) -> Trust:
        """``items``: PEM file paths, raw 64-hex-digit public keys, or key objects."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        keys = {}
        for it in items:
            if isinstance(it, Ed25519PublicKey):
                k = it
            elif isinstance(it, str) and len(it) == 64 and all(c in "0123456789abcdef" for c in it.lower()):
                k = Ed25519PublicKey.from_public_bytes(bytes.fromhex(it))
            else:
                with open(it, "rb") as f:
                    k = serialization.load_pem_public_key(f.read())
                if not isinstance(k, Ed25519PublicKey):
                    raise ValueError(f"{it}: not an Ed25519 public key")
            keys[key_id(_public_raw(k))] = k
        if threshold < 1 or (keys and threshold > len(keys)):
            raise ValueError(f"signature threshold {threshold} needs 1..{len(keys)} trusted keys")
        return cls(keys, threshold, allow_unsigned)

    def also_trusting(self, signer: Signer | None) -> Trust:
        """This trust plus ``signer``'s own public keys: a publisher reading back its own store
        (its LATEST, the chain it resumes from) trusts what it signed, whatever else is configured."""
        if signer is None:
            return self
        keys = dict(self.keys)
        for k in signer.public_keys():
            keys[key_id(_public_raw(k))] = k
        return Trust(keys, self.threshold if self.keys else 1, self.allow_unsigned)

    @property
    def configured(self) -> bool:
        return bool(self.keys) or self.allow_unsigned

    def verify(self, data: bytes, signatures: list | None, what: str) -> int:
        """Raise :class:`SignatureError` unless ``threshold`` distinct trusted keys signed ``data``;
        returns how many did (0 where unsigned data is allowed and there is no signature)."""
        if not self.keys:
            if self.allow_unsigned:
                return 0
            raise SignatureError(
                f"{what}: no trusted keys configured; set ENGINE_EXT_TRUSTED_KEYS to the publisher's "
                "public key(s), or ENGINE_EXT_ALLOW_UNSIGNED=1 to accept unsigned updates explicitly"
            )
        from cryptography.exceptions import InvalidSignature

        good = set()
        for s in signatures or []:
            if not isinstance(s, dict) or not isinstance(s.get("keyid"), str) or not isinstance(s.get("sig"), str):
                continue
            k = self.keys.get(s["keyid"])
            if k is None or s["keyid"] in good:
                continue
            try:
                k.verify(bytes.fromhex(s["sig"]), data)
            except (InvalidSignature, ValueError):
                continue
            good.add(s["keyid"])
        if len(good) < self.threshold:
            if not signatures and self.allow_unsigned:
                return 0
            raise SignatureError(
                f"{what}: not signed by {self.threshold} trusted key(s) "
                f"({len(good)} valid of {len(signatures or [])} signature(s))"
            )
        return len(good)

    def verify_detached(self, data: bytes, sig_object: bytes | None, what: str) -> int:
        """Verify ``data`` against the content of its ``.sig`` object (None: the object is absent)."""
        signatures = None
        if sig_object is not None:
            try:
                signatures = json.loads(sig_object)["signatures"]
            except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
                raise SignatureError(f"{what}: malformed signature object") from None
            if not isinstance(signatures, list):
                raise SignatureError(f"{what}: malformed signature object")
        return self.verify(data, signatures, what)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
