"""Plain HTTP(S) as a store (any static file server, CDN, presigned base URL); PUT when writable."""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable

from .. import settings
from ..errors import ConflictError, ForbiddenSourceError, IntegrityError, NotFoundError, SourceError
from ..format.latest import MAX_LATEST_BYTES
from .base import _CONTENT_RANGE, Connection, NetworkStore, ReadCut, _check_key, _short, _too_large


class HttpStore(NetworkStore):
    """Read-only store over plain HTTP(S) (any static file server, CDN, presigned base URL).

    ``requests.Session`` with connect/read timeouts and urllib3 ``Retry`` (exponential
    backoff on connection errors and 429/5xx, honouring Retry-After). Ranges use
    ``Range:`` and check the 206's ``Content-Range``; a server that ignores Range and
    answers 200 is read only up to the end of the wanted range, then the connection is
    dropped, so memory stays bounded by what was asked for. Bodies are read as they
    arrive (never decompressed), so the store's deadline holds against a trickling
    server. Redirects are followed only below the store's root (:meth:`_may_redirect`),
    and ``token`` (or ``ENGINE_EXT_HTTP_TOKEN``) is sent as ``Authorization: Bearer``
    only to URLs below the root. ``writable=True`` enables ``write`` by HTTP PUT;
    atomicity then is the server's to guarantee. ``connection``: timeouts, retries and pool size (a
    :class:`Connection`, shared with the S3 store).
    """

    MAX_REDIRECTS = 5

    def __init__(
        self,
        root: str,
        *,
        token: str | None = None,
        backoff: float = 0.25,
        max_object_bytes: int | None = None,
        writable: bool = False,
        connection: Connection | None = None,
    ):
        import requests
        from requests.adapters import HTTPAdapter
        from urllib3.util.retry import Retry

        parts = urllib.parse.urlsplit(root)
        if parts.query or parts.fragment:
            raise SourceError(f"HTTP store root {root!r} must not carry a query or fragment")
        self.uri = root.rstrip("/")
        c = connection or Connection()
        self.connect_timeout, self.read_timeout = c.connect_timeout, c.read_timeout
        self.max_object_bytes = max_object_bytes
        self.writable = writable
        self.retries, self.backoff = c.retries, backoff
        self.session = requests.Session()
        retry = Retry(
            total=c.retries,
            connect=c.retries,
            read=c.retries,
            status=c.retries,
            other=0,
            redirect=0,
            backoff_factor=backoff,
            backoff_max=10.0,
            status_forcelist=(429, 500, 502, 503, 504),
            allowed_methods=frozenset({"GET", "HEAD", "PUT"}),
            raise_on_status=False,
            respect_retry_after_header=True,
        )
        adapter = HTTPAdapter(max_retries=retry, pool_connections=4, pool_maxsize=c.pool_size)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        # No transparent gzip: Content-Length and byte ranges must refer to the stored bytes.
        self.session.headers["Accept-Encoding"] = "identity"
        self.session.trust_env = False  # no proxies or .netrc credentials picked up from the environment
        token = token if token is not None else settings.current().http_token
        self._auth = f"Bearer {token}" if token else None

    def key_uri(self, key: str) -> str:
        return f"{self.uri}/{urllib.parse.quote(_check_key(key, self.uri))}"

    def _url(self, key: str) -> str:
        """The HTTP URL of a key (differs from ``key_uri`` for hf:// stores)."""
        return self.key_uri(key)

    def _base(self) -> str:
        """The HTTP URL every object of this store lies under."""
        return self.uri

    def _below_base(self, url: str) -> bool:
        u, b = urllib.parse.urlsplit(url), urllib.parse.urlsplit(self._base())
        return (u.scheme, u.netloc) == (b.scheme, b.netloc) and u.path.startswith(b.path.rstrip("/") + "/")

    def _may_redirect(self, url: str) -> bool:
        """Whether to follow a redirect to ``url``: only below the store's root."""
        return self._below_base(url)

    def _timeout(self, what: str) -> tuple[float, float]:
        left = self.remaining(what)
        return (self.connect_timeout, self.read_timeout if left is None else min(self.read_timeout, left))

    def _request(self, method: str, key: str, **kw):
        import requests

        url = self._url(key)
        headers = dict(kw.pop("headers", None) or {})
        for _ in range(self.MAX_REDIRECTS + 1):
            hdrs = dict(headers, Authorization=self._auth) if self._auth and self._below_base(url) else headers
            try:
                r = self.session.request(
                    method,
                    url,
                    timeout=self._timeout(f"{method} {self.key_uri(key)}"),
                    allow_redirects=False,
                    headers=hdrs,
                    **kw,
                )
            except requests.RequestException as e:
                raise SourceError(
                    f"{method} {self.key_uri(key)} failed after {self.retries} retries: "
                    f"{type(e).__name__}: {str(e)[:300]}"
                ) from e
            if not r.is_redirect:
                return r
            target = urllib.parse.urljoin(url, r.headers.get("Location", ""))
            r.close()
            if not self._may_redirect(target):
                raise ForbiddenSourceError(f"{method} {self.key_uri(key)}: redirect out of the store refused")
            url = target
        raise SourceError(f"{method} {self.key_uri(key)}: more than {self.MAX_REDIRECTS} redirects")

    def _fail(self, r, what: str, key: str):
        url = self.key_uri(key)
        code = r.status_code
        r.close()
        if code == 404 or code == 410:
            return NotFoundError(f"not found: {url} (HTTP {code})")
        if code == 416:
            return IntegrityError(f"{what} {url}: range not satisfiable (HTTP 416), object is shorter than asked")
        if code in (401, 403):
            return SourceError(f"{what} {url}: access denied (HTTP {code}); check the token")
        return SourceError(f"{what} {url}: HTTP {code} {(r.reason or '')[:100]}".rstrip())

    def _stream(self, r, url: str, until: int | None):
        """Read the body as it arrives (raw bytes, never decompressed), checking the deadline
        between reads; stop once ``until`` bytes are in (None: the whole body)."""
        import requests
        from urllib3.exceptions import HTTPError

        buf = bytearray()
        try:
            while until is None or len(buf) < until:
                self.remaining(f"reading {url}")
                chunk = r.raw.read1(1 << 20, decode_content=False)
                if not chunk:
                    break
                buf += chunk
                yield buf
        except (requests.RequestException, HTTPError, OSError) as e:
            raise ReadCut(f"reading {url} failed mid-body: {type(e).__name__}: {str(e)[:300]}") from e
        finally:
            r.close()

    def _body(self, r, limit: int | None, url: str) -> bytes:
        n = r.headers.get("Content-Length")
        if n is not None and not n.isdigit():
            r.close()
            raise SourceError(f"reading {url}: bad Content-Length")
        if limit is not None and n is not None and int(n) > limit:
            r.close()
            raise _too_large(url, int(n), limit)
        buf = bytearray()
        for buf in self._stream(r, url, None):
            if limit is not None and len(buf) > limit:
                r.close()
                raise _too_large(url, len(buf), limit)
        if n is not None and len(buf) != int(n):
            raise ReadCut(f"reading {url}: got {len(buf)} bytes, Content-Length said {n}")
        return bytes(buf)

    def _read(self, key: str, max_bytes: int | None) -> bytes:
        r = self._request("GET", key, stream=True)
        if r.status_code != 200:
            raise self._fail(r, "GET", key)
        limit = max_bytes if max_bytes is not None else self.max_object_bytes
        return self._body(r, limit, self.key_uri(key))

    def _read_range(self, key: str, start: int, length: int) -> bytes:
        url = self.key_uri(key)
        end = start + length - 1
        r = self._request("GET", key, stream=True, headers={"Range": f"bytes={start}-{end}"})
        if r.status_code == 206:
            m = _CONTENT_RANGE.fullmatch(r.headers.get("Content-Range", "").strip())
            if not m or int(m.group(1)) != start:
                r.close()
                raise SourceError(f"GET {url}: bad Content-Range for bytes={start}-{end}")
            got_end = int(m.group(2))
            if got_end < end:
                r.close()
                raise _short(url, start, length, got_end + 1)
            data = self._body(r, length, url)
            if len(data) != length:
                raise _short(url, start, length, start + len(data))
            return data
        if r.status_code == 200:  # Range ignored: skip to start, keep length bytes, hang up
            buf = bytearray()
            for buf in self._stream(r, url, start + length):
                pass
            if len(buf) < start + length:
                raise _short(url, start, length, len(buf))
            return bytes(buf[start : start + length])
        raise self._fail(r, "GET", key)

    def exists(self, key: str) -> bool:
        r = self._request("HEAD", key)
        if r.status_code == 200:
            return True
        err = self._fail(r, "HEAD", key)
        if isinstance(err, NotFoundError):
            return False
        raise err

    def size(self, key: str) -> int:
        r = self._request("HEAD", key)
        if r.status_code != 200:
            raise self._fail(r, "HEAD", key)
        if "Content-Length" in r.headers:
            return int(r.headers["Content-Length"])
        # No length on HEAD (some CDNs): ask for one byte and read the total from Content-Range.
        r = self._request("GET", key, stream=True, headers={"Range": "bytes=0-0"})
        m = _CONTENT_RANGE.fullmatch(r.headers.get("Content-Range", "").strip())
        r.close()
        if r.status_code == 206 and m and m.group(3) != "*":
            return int(m.group(3))
        raise SourceError(f"{self.key_uri(key)}: server reports no object size")

    def write(self, key: str, data: bytes, headers: dict | None = None) -> None:
        """HTTP PUT; ``headers`` carry the conditions of :meth:`create` and :meth:`write_if`
        (412 Precondition Failed: :class:`ConflictError`)."""
        if not self.writable:
            raise SourceError(
                f"{self.uri} is a read-only HTTP store; publish to a local dir or s3:// "
                "and serve that (or open it with writable=True for an HTTP PUT server)"
            )
        r = self._request("PUT", key, data=data, headers=headers)
        if r.status_code == 412:
            r.close()
            raise ConflictError(
                f"PUT {self.key_uri(key)}: precondition failed ({(headers or {})}): it changed or exists"
            )
        if r.status_code not in (200, 201, 204):
            raise self._fail(r, "PUT", key)
        r.close()

    def create(self, key: str, data: bytes) -> None:
        self.write(key, data, headers={"If-None-Match": "*"})

    def write_if(
        self, key: str, data: bytes, check: Callable[[bytes | None], None], max_bytes: int = MAX_LATEST_BYTES
    ) -> None:
        """GET (with its ETag), check, then PUT with ``If-Match`` (or ``If-None-Match: *`` where there
        was nothing); a server that sends no ETag gets a plain PUT (not atomic against a racer)."""
        r = self._request("GET", key, stream=True)
        if r.status_code == 200:
            etag = r.headers.get("ETag")
            current = self._body(r, max_bytes, self.key_uri(key))
        elif r.status_code in (404, 410):
            r.close()
            etag, current = None, None
        else:
            raise self._fail(r, "GET", key)
        check(current)
        self.write(
            key, data, headers={"If-Match": etag} if etag else ({"If-None-Match": "*"} if current is None else None)
        )
