"""``hf://buckets/<namespace>/<name>[/prefix]``: Hugging Face Storage Buckets as a store."""

from __future__ import annotations

import os
import re
import urllib.parse

from ..errors import NotFoundError, SourceError
from .base import Store, _check_key, _check_prefix
from .http import HttpStore


class HfBucketStore(HttpStore):
    """``hf://buckets/<namespace>/<name>[/prefix]``: Hugging Face Storage Buckets.

    UNTESTED against the real Hub (no network here). Reads are plain HTTP GET/Range on
    ``{endpoint}/buckets/<id>/resolve/<path>`` with the HF token, the URL that
    ``huggingface_hub.HfFileSystem`` (2.4) uses for bucket files; they go through the
    tested ``HttpStore`` code. Writes and listings call ``huggingface_hub``
    (``HfApi.batch_bucket_files``, ``HfApi.list_bucket_tree``), imported lazily; a
    version without the bucket API gets a clear error. Per-object write atomicity is
    the Hub's (not verified here).
    """

    def __init__(self, root: str, *, token: str | None = None, endpoint: str | None = None, **http_options):
        m = re.fullmatch(r"hf://buckets/([^/]+)/([^/]+)(?:/(.*))?", root.rstrip("/"))
        if not m:
            raise SourceError(f"not an hf://buckets/<namespace>/<name>[/prefix] URI: {root!r}")
        self.bucket_id = f"{m.group(1)}/{m.group(2)}"
        self.prefix = (m.group(3) or "").strip("/")
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
        if token is None:
            token = os.environ.get("HF_TOKEN")
            if token is None:
                try:
                    from huggingface_hub import get_token

                    token = get_token()
                except ImportError:
                    pass
        self.hf_token = token
        base = f"{self.endpoint}/buckets/{self.bucket_id}/resolve" + (
            f"/{urllib.parse.quote(self.prefix)}" if self.prefix else ""
        )
        super().__init__(base, token=token or "", **http_options)
        self.http_uri = self.uri
        self.uri = f"hf://buckets/{self.bucket_id}" + (f"/{self.prefix}" if self.prefix else "")

    def key_uri(self, key: str) -> str:
        return f"{self.uri}/{_check_key(key, self.uri)}"

    def _url(self, key: str) -> str:
        return f"{self.http_uri}/{urllib.parse.quote(_check_key(key, self.uri))}"

    def _base(self) -> str:
        return self.http_uri

    def _may_redirect(self, url: str) -> bool:
        """The Hub answers ``resolve`` with a redirect to its CDN: follow HTTPS redirects
        anywhere (the token goes only below this bucket's URL; contents are verified by
        SHA-256 from the signed manifest anyway)."""
        return urllib.parse.urlsplit(url).scheme == "https" or self._below_base(url)

    def _api(self, needs: str):
        try:
            from huggingface_hub import HfApi
        except ImportError:
            raise SourceError(
                f"{self.uri}: writing/listing HF buckets needs huggingface_hub: pip install 'engine-ext[hf]'"
            ) from None
        api = HfApi(endpoint=self.endpoint, token=self.hf_token)
        if not hasattr(api, needs):
            import huggingface_hub

            raise SourceError(
                f"{self.uri}: huggingface_hub {huggingface_hub.__version__} has no bucket API ({needs}); upgrade it"
            )
        return api

    def _path(self, key: str) -> str:
        _check_key(key, self.uri)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _hub(self, what: str, key: str | None, fn):
        try:
            return fn()
        except Exception as e:  # huggingface_hub raises HfHubHTTPError subclasses, OSError, ValueError
            where = self.key_uri(key) if key else self.uri
            if type(e).__name__ in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
                raise NotFoundError(f"not found: {where}") from e
            raise SourceError(f"{what} {where} failed: {type(e).__name__}: {e}") from e

    # No conditional writes in the bucket API: check, then write (the Store defaults; not atomic).
    create, create_file, write_if = Store.create, Store.create_file, Store.write_if

    def write(self, key: str, data: bytes) -> None:
        api = self._api("batch_bucket_files")
        self._hub("upload", key, lambda: api.batch_bucket_files(self.bucket_id, add=[(data, self._path(key))]))

    def write_file(self, key: str, path: str | os.PathLike) -> None:
        api = self._api("batch_bucket_files")
        self._hub(
            "upload", key, lambda: api.batch_bucket_files(self.bucket_id, add=[(os.fspath(path), self._path(key))])
        )

    def list(self, prefix: str = "") -> list[str]:
        _check_prefix(prefix, self.uri)
        api = self._api("list_bucket_tree")
        base = f"{self.prefix}/" if self.prefix else ""
        entries = self._hub(
            "list", None, lambda: list(api.list_bucket_tree(self.bucket_id, base or None, recursive=True))
        )
        return sorted(
            e.path[len(base) :]
            for e in entries
            if getattr(e, "type", "file") == "file" and e.path.startswith(base + prefix)
        )
