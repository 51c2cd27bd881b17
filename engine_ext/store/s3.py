"""``s3://bucket/prefix`` as a store through boto3 (AWS, R2, MinIO, GCS interop, moto)."""

from __future__ import annotations

import os
import threading
import urllib.parse
from collections.abc import Callable

from .. import settings
from ..errors import ConflictError, IntegrityError, NotFoundError, SourceError
from ..format.latest import MAX_LATEST_BYTES
from .base import _CONTENT_RANGE, Connection, NetworkStore, ReadCut, _check_key, _check_prefix, _short, _too_large

_S3_CLIENTS: dict[tuple, object] = {}
_S3_LOCK = threading.Lock()


def _s3_client(endpoint_url, region, addressing_style, connection: Connection):
    """boto3 clients are thread-safe and slow to build: share one per configuration."""
    # Credentials are resolved when a client is built: key on the env that feeds them too.
    creds = tuple(
        os.environ.get(v) for v in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
    )
    key = (endpoint_url, region, addressing_style, connection, os.getpid(), creds)
    with _S3_LOCK:
        if key not in _S3_CLIENTS:
            try:
                import boto3
                from botocore.config import Config
            except ImportError:
                raise SourceError("s3:// stores need boto3: pip install 'engine-ext[s3]'") from None
            cfg = Config(
                region_name=region,
                connect_timeout=connection.connect_timeout,
                read_timeout=connection.read_timeout,
                retries={"max_attempts": connection.retries + 1, "mode": "standard"},
                max_pool_connections=connection.pool_size,
                s3={"addressing_style": addressing_style},
            )
            _S3_CLIENTS[key] = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=cfg)
        return _S3_CLIENTS[key]


class S3Store(NetworkStore):
    """``s3://bucket/prefix`` through boto3 (AWS, R2, MinIO, GCS interop, moto).

    Endpoint: option ``endpoint_url``, else env ``ENGINE_EXT_S3_ENDPOINT``, else
    ``AWS_ENDPOINT_URL``; custom endpoints default to path-style addressing. PutObject is
    atomic per object, which is all ``publish_version`` needs. Credentials come from the
    usual boto3 chain (env, profile, instance role).
    """

    read_request = "GetObject"

    def __init__(
        self,
        root: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        addressing_style: str | None = None,
        max_object_bytes: int | None = None,
        multipart_threshold: int = 64 << 20,
        multipart_chunksize: int = 64 << 20,
        connection: Connection | None = None,
    ):
        parts = urllib.parse.urlsplit(root)
        if parts.scheme != "s3" or not parts.netloc:
            raise SourceError(f"not an s3://bucket[/prefix] URI: {root!r}")
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        self.uri = f"s3://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self.endpoint_url = endpoint_url or settings.current().s3_endpoint or os.environ.get("AWS_ENDPOINT_URL") or None
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        style = addressing_style or ("path" if self.endpoint_url else "auto")
        c = connection or Connection()
        self.client = _s3_client(self.endpoint_url, region, style, c)
        self.retries = c.retries
        self.max_object_bytes = max_object_bytes
        self.multipart = (multipart_threshold, multipart_chunksize)
        self.list_page_size = 1000

    def _k(self, key: str) -> str:
        _check_key(key, self.uri)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, key: str | None, fn, **kw):
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        where = self.key_uri(key) if key is not None else self.uri
        self.remaining(f"{what} {where}")
        try:
            return fn(**kw)
        except ClientError as e:
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            msg = f"{what} {where}: {code or status} {err.get('Message', '')}".rstrip()
            if code == "NoSuchBucket":
                raise SourceError(
                    f"{msg} (bucket {self.bucket!r} does not exist at {self.endpoint_url or 'AWS'})"
                ) from e
            if code in ("NoSuchKey", "404", "NotFound") or status == 404:
                raise NotFoundError(f"not found: {where}") from e
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
                raise ConflictError(f"{what} {where}: it exists or changed meanwhile ({code or status})") from e
            if code == "InvalidRange" or status == 416:
                raise IntegrityError(f"{what} {where}: range not satisfiable, object is shorter than asked") from e
            raise SourceError(msg) from e
        except (BotoCoreError, Boto3Error) as e:  # no connection, no credentials, failed upload
            raise SourceError(f"{what} {where} failed (endpoint {self.endpoint_url or 'AWS'}): {e}") from e

    def _read_body(self, resp, where: str, limit: int | None = None) -> bytes:
        """The body in chunks, checking the deadline between them; never more than ``limit`` + 1 bytes."""
        from botocore.exceptions import BotoCoreError

        buf = bytearray()
        try:
            with resp["Body"] as body:
                while True:
                    self.remaining(f"reading {where}")
                    chunk = body.read(1 << 20)
                    if not chunk:
                        return bytes(buf)
                    buf += chunk
                    if limit is not None and len(buf) > limit:
                        raise _too_large(where, len(buf), limit)
        except (BotoCoreError, OSError) as e:
            raise ReadCut(f"reading {where} failed mid-body: {e}") from e

    def _read(self, key: str, max_bytes: int | None) -> bytes:
        resp = self._call("GetObject", key, self.client.get_object, Bucket=self.bucket, Key=self._k(key))
        limit = max_bytes if max_bytes is not None else self.max_object_bytes
        if limit is not None and resp["ContentLength"] > limit:
            resp["Body"].close()
            raise _too_large(self.key_uri(key), resp["ContentLength"], limit)
        return self._read_body(resp, self.key_uri(key), limit)

    def _read_range(self, key: str, start: int, length: int) -> bytes:
        end = start + length - 1
        resp = self._call(
            "GetObject", key, self.client.get_object, Bucket=self.bucket, Key=self._k(key), Range=f"bytes={start}-{end}"
        )
        m = _CONTENT_RANGE.fullmatch(resp.get("ContentRange", "") or "")
        if m and int(m.group(2)) < end:
            resp["Body"].close()
            raise _short(self.key_uri(key), start, length, int(m.group(2)) + 1)
        data = self._read_body(resp, self.key_uri(key), length)
        if len(data) != length:
            raise _short(self.key_uri(key), start, length, start + len(data))
        return data

    def write(self, key: str, data: bytes) -> None:
        self._call("PutObject", key, self.client.put_object, Bucket=self.bucket, Key=self._k(key), Body=data)

    def create(self, key: str, data: bytes) -> None:
        """PutObject with ``If-None-Match: *`` (S3's conditional write: 412 if the key exists)."""
        self._call(
            "PutObject", key, self.client.put_object, Bucket=self.bucket, Key=self._k(key), Body=data, IfNoneMatch="*"
        )

    def create_file(self, key: str, path: str | os.PathLike) -> None:
        """Conditional PutObject up to ``multipart_threshold``; above it a check before the multipart
        upload (boto3's transfer manager sends no ``If-None-Match``). Publishers write blobs under
        content-addressed keys, so even a racer that slips in writes the same bytes."""
        if os.path.getsize(path) <= self.multipart[0]:
            with open(path, "rb") as f:
                return self.create(key, f.read())
        if self.exists(key):
            raise ConflictError(f"{self.key_uri(key)} already exists")
        self.write_file(key, path)

    def write_if(
        self, key: str, data: bytes, check: Callable[[bytes | None], None], max_bytes: int = MAX_LATEST_BYTES
    ) -> None:
        """GetObject (bytes and ETag), check, then PutObject with ``If-Match`` (``If-None-Match: *``
        where there was nothing); when another writer got in between, read and check again."""
        for _ in range(8):
            try:
                resp = self._call("GetObject", key, self.client.get_object, Bucket=self.bucket, Key=self._k(key))
                current, cond = self._read_body(resp, self.key_uri(key), max_bytes), {"IfMatch": resp["ETag"]}
            except NotFoundError:
                current, cond = None, {"IfNoneMatch": "*"}
            check(current)
            try:
                self._call(
                    "PutObject", key, self.client.put_object, Bucket=self.bucket, Key=self._k(key), Body=data, **cond
                )
                return
            except ConflictError:
                continue  # it moved between our read and our write: look again
        raise ConflictError(f"{self.key_uri(key)} kept changing while it was being replaced")

    def write_file(self, key: str, path: str | os.PathLike) -> None:
        """Streams from disk; multipart above ``multipart_threshold`` (S3 completes a
        multipart upload atomically, so readers still never see a partial object)."""
        from boto3.s3.transfer import TransferConfig

        cfg = TransferConfig(multipart_threshold=self.multipart[0], multipart_chunksize=self.multipart[1])
        self._call(
            "Upload",
            key,
            self.client.upload_file,
            Filename=os.fspath(path),
            Bucket=self.bucket,
            Key=self._k(key),
            Config=cfg,
        )

    def _head(self, key: str) -> dict:
        return self._call("HeadObject", key, self.client.head_object, Bucket=self.bucket, Key=self._k(key))

    def exists(self, key: str) -> bool:
        try:
            self._head(key)
            return True
        except NotFoundError:
            return False

    def size(self, key: str) -> int:
        return int(self._head(key)["ContentLength"])

    def list(self, prefix: str = "") -> list[str]:
        _check_prefix(prefix, self.uri)
        base = f"{self.prefix}/" if self.prefix else ""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=base + prefix, PaginationConfig={"PageSize": self.list_page_size}
        )
        keys = self._call("ListObjectsV2", None, lambda: [o["Key"] for p in pages for o in p.get("Contents", [])])
        return sorted(k[len(base) :] for k in keys)
