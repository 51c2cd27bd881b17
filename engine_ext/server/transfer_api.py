"""What the payloads of vLLM's weight-transfer API mean to an engine_ext server (engine-agnostic).

vLLM 0.32 lets a trainer drive weight sync with four calls: ``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``. The vLLM adapter serves
them online (its dev-mode HTTP routes, :mod:`engine_ext.engines.vllm.endpoint`) and offline
(the ``engine_ext`` weight-transfer backend, :mod:`engine_ext.engines.vllm.backend`); both run
them through the server's one :class:`~engine_ext.server.controller.Controller`, and both read
the payloads here:

* ``init_info`` ``{"sources": [...], "trusted_keys": [...]}`` (both optional) narrows what that
  door accepts: each source must lie under one of the server's ``ENGINE_EXT_SOURCES``, each key
  must be one of its ``ENGINE_EXT_TRUSTED_KEYS``, given as PEM text or as its key id (16 hex
  digits; never a file path, which would let a caller probe the server's disk). Anything
  wider is refused (403 ``widens_policy``) and changes nothing: the caller of an
  unauthenticated dev-mode route can never make the server accept more than its operator
  configured. An empty ``init_info`` restores the server's own policy.
* ``update_info`` ``{"url": MANIFEST_URI}`` (and optionally ``"base_version"``) is an
  :class:`~engine_ext.server.protocol.UpdateRequest`: the same transaction as
  ``POST /update_weights_delta``. It waits for a running update (vLLM's clients do not retry a
  409) and never goes back to an older version (no ``rollback``).
"""

from __future__ import annotations

from ..errors import DeltaError, ForbiddenSourceError
from ..store.signing import Trust, _public_raw, key_id
from ..store.sources import Sources
from .controller import Policy
from .protocol import RequestError, UpdateRequest, short

MAX_ITEMS = 64  # entries in a narrowing list
MAX_ITEM_CHARS = 4096
UPDATE_FIELDS = ("url", "base_version")


class WideningError(DeltaError):
    """``init_weight_transfer_engine`` asked for more than the server allows (a source outside its
    ENGINE_EXT_SOURCES, a key it does not trust)."""

    reason, http_status = "widens_policy", 403


def _strings(init_info: dict, name: str) -> list[str] | None:
    items = init_info.get(name)
    if items is None:
        return None
    if (
        not isinstance(items, list)
        or not items
        or len(items) > MAX_ITEMS
        or not all(isinstance(x, str) and 0 < len(x) <= MAX_ITEM_CHARS for x in items)
    ):
        raise RequestError(
            f"init_info {name!r} must be a non-empty list of at most {MAX_ITEMS} strings "
            "(leave it out to keep the server's own)"
        )
    return items


def _key(item: str, trusted: dict):
    """(key id, key) of ``item`` (PEM text or a key id) among ``trusted``; WideningError if it is not there."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    kid = item.strip().lower()
    if item.lstrip().startswith("-----BEGIN"):
        try:
            k = serialization.load_pem_public_key(item.encode())
        except ValueError as e:
            raise RequestError(f"init_info trusted_keys: not a PEM public key ({str(e)[:80]})") from None
        if not isinstance(k, Ed25519PublicKey):
            raise RequestError("init_info trusted_keys: not an Ed25519 public key")
        kid = key_id(_public_raw(k))
    elif not (len(kid) == 16 and all(c in "0123456789abcdef" for c in kid)):
        raise RequestError(
            f"init_info trusted_keys: {short(item, 40)} is neither PEM text nor a key id (16 hex digits)"
        )
    if kid not in trusted:
        raise WideningError(
            f"key {kid} is not among the server's trusted keys (ENGINE_EXT_TRUSTED_KEYS): "
            "init_weight_transfer_engine may only narrow them"
        )
    return kid, trusted[kid]


def narrow(init_info: dict | None, server: Policy) -> Policy:
    """The policy of a door after ``init_weight_transfer_engine(init_info)``: ``server``'s, narrowed.
    Raises (nothing changed) on a malformed payload (400) or one that would widen it (403)."""
    if init_info is None or init_info == {}:
        return server
    if not isinstance(init_info, dict):
        raise RequestError('init_info must be a JSON object like {"sources": [...], "trusted_keys": [...]}')
    unknown = sorted(set(init_info) - {"sources", "trusted_keys"})
    if unknown:
        raise RequestError(f"unknown init_info field(s) {short(unknown)}; allowed: sources, trusted_keys")
    sources, trust = server.sources, server.trust
    wanted = _strings(init_info, "sources")
    if wanted is not None:
        for src in wanted:
            try:
                server.sources.check(src)
            except ForbiddenSourceError as e:
                raise WideningError(f"{e}: init_weight_transfer_engine may only narrow the server's sources") from None
        sources = Sources(wanted, origin="ENGINE_EXT_SOURCES as narrowed by init_weight_transfer_engine")
    keys = _strings(init_info, "trusted_keys")
    if keys is not None:
        if not server.trust.keys:
            raise WideningError(
                "the server trusts no keys (ENGINE_EXT_TRUSTED_KEYS is empty): there is nothing to "
                "narrow to; configure the keys on the server"
            )
        chosen = dict(_key(k, server.trust.keys) for k in keys)
        if len(chosen) < server.trust.threshold:
            raise RequestError(
                f"{len(chosen)} key(s) cannot meet the server's signature threshold "
                f"{server.trust.threshold} (ENGINE_EXT_SIGNATURE_THRESHOLD)"
            )
        trust = Trust(chosen, server.trust.threshold, allow_unsigned=False)  # named keys: signatures required
    return Policy(sources, trust)


def describe(policy: Policy, server: Policy) -> dict:
    """What a door accepts, for status answers: how many sources, which key ids, whether narrowed
    (the prefixes themselves are not echoed: errors and status never list the allow-list)."""
    return {
        "narrowed": policy is not server,
        "sources": len(policy.sources.prefixes),
        "trusted_keys": sorted(policy.trust.keys),
        "allow_unsigned": policy.trust.allow_unsigned,
    }


def update_request(update_info) -> UpdateRequest:
    """``update_weights(update_info)``'s payload as an update request. A list (vLLM's per-rank form)
    must name one version: every rank fetches its own part of it itself."""
    if isinstance(update_info, list):
        if not update_info or any(u != update_info[0] for u in update_info):
            raise RequestError(
                'a per-rank update_info list must repeat one {"url": ...}: every rank fetches its '
                "own part of the version itself"
            )
        update_info = update_info[0]
    if not isinstance(update_info, dict):
        raise RequestError('update_info must be a JSON object like {"url": "<manifest URI>"}')
    unknown = sorted(set(update_info) - set(UPDATE_FIELDS))
    if unknown:
        raise RequestError(f"unknown update_info field(s) {short(unknown)}; allowed: {list(UPDATE_FIELDS)}")
    return UpdateRequest.parse({**update_info, "wait": True})


__all__ = ["WideningError", "describe", "narrow", "update_request"]
