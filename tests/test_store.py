"""Storage backends against real servers on loopback: local dir, file://, a real HTTP
server (tests/servers.py, with Range), a real S3-compatible moto_server. Only the
Hugging Face Hub is out of reach offline: its read path is exercised against the local
HTTP server laid out like the Hub's bucket URLs; its writes are not tested."""

import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from engine_ext import settings
from engine_ext.errors import ConflictError, ForbiddenSourceError, IntegrityError, NotFoundError, SourceError
from engine_ext.format.latest import Latest
from engine_ext.store import HfBucketStore, HttpStore, LocalStore, S3Store, open_store, publish_version, split_uri
from servers import free_port

DATA = random.Random(0).randbytes(100_003)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check_readable(store, key="a/b/blob.bin", data=DATA):
    """Read-side contract, for an object ``key`` holding ``data``."""
    assert store.read(key) == data
    assert store.exists(key) and not store.exists("a/b/nope.bin")
    assert store.size(key) == len(data)
    assert store.read_range(key, 0, 10) == data[:10]
    assert store.read_range(key, 12_345, 6_789) == data[12_345:19_134]
    assert store.read_range(key, len(data) - 3, 3) == data[-3:]
    assert store.read_range(key, 5, 0) == b""
    ranges = [(i * 1_999 % len(data), 1 + i * 97 % 3_000) for i in range(40)]
    ranges = [(s, min(n, len(data) - s)) for s, n in ranges]
    assert store.read_ranges(key, ranges, workers=8) == [data[s:s + n] for s, n in ranges]
    with pytest.raises(IntegrityError):  # past the end: the object is shorter than asked
        store.read_range(key, len(data) - 3, 4)
    with pytest.raises(IntegrityError):
        store.read_range(key, len(data) + 10, 4)
    with pytest.raises(NotFoundError, match="nope"):
        store.read("a/b/nope.bin")
    with pytest.raises(NotFoundError):
        store.read_range("a/b/nope.bin", 0, 4)
    with pytest.raises(NotFoundError):
        store.size("a/b/nope.bin")
    with pytest.raises(SourceError, match="over the limit"):
        store.read(key, max_bytes=len(data) - 1)
    assert store.read(key, max_bytes=len(data)) == data
    for bad in ("../x", "/etc/passwd", "a/../../x", "a//b", "", "a\\b", "./x"):
        with pytest.raises(ForbiddenSourceError):
            store.read(bad)
    with pytest.raises(ValueError):
        store.read_range(key, -1, 4)


def check_writable(store):
    store.write("a/b/blob.bin", b"first version")
    store.write("a/b/blob.bin", DATA)  # overwrite in place
    check_readable(store)
    store.write("empty", b"")
    assert store.read("empty") == b"" and store.size("empty") == 0
    store.write("v00000001.json", b"{}")
    store.write("v00000002.json", b"{}")
    assert store.list() == ["a/b/blob.bin", "empty", "v00000001.json", "v00000002.json"]
    assert store.list("v0000000") == ["v00000001.json", "v00000002.json"]
    assert store.list("a/") == ["a/b/blob.bin"]
    assert store.list("a/b/bl") == ["a/b/blob.bin"]
    assert store.list("zzz") == []
    with pytest.raises(ForbiddenSourceError):
        store.write("../escape", b"x")


# --------------------------------------------------------------------------- local


def test_local_store(tmp_path):
    store = open_store(tmp_path / "run")
    assert isinstance(store, LocalStore) and store.uri == str(tmp_path / "run")
    check_writable(store)
    assert store.key_uri("a/b/blob.bin") == str(tmp_path / "run" / "a" / "b" / "blob.bin")
    assert not (tmp_path / "escape").exists()
    with pytest.raises(NotFoundError):
        store.read("a/b")  # a directory is not an object
    assert oct((tmp_path / "run" / "empty").stat().st_mode & 0o777) == "0o644"


def test_file_uri_store(tmp_path):
    store = open_store(f"file://{tmp_path}/run")
    assert isinstance(store, LocalStore) and store.uri == f"file://{tmp_path}/run"
    check_writable(store)
    assert store.key_uri("v00000001.json") == f"file://{tmp_path}/run/v00000001.json"
    assert (tmp_path / "run" / "v00000001.json").read_bytes() == b"{}"
    src = tmp_path / "big.bin"
    src.write_bytes(DATA * 20)
    store.write_file("big.bin", src)
    assert store.read("big.bin") == DATA * 20


def test_local_write_leaves_no_partial_object(tmp_path):
    """A write that fails midway leaves the old bytes and no stray temp file."""
    store = open_store(tmp_path)
    store.write("LATEST", b"1")

    def bad_fill(f):
        f.write(b"half")
        raise OSError("disk full (simulated)")

    with pytest.raises(SourceError, match="disk full"):
        store._atomic("LATEST", bad_fill)
    assert store.read("LATEST") == b"1"
    assert os.listdir(tmp_path) == ["LATEST"]


# --------------------------------------------------------------------------- HTTP


@pytest.fixture
def http(http_server):
    http_server.reset()
    run = http_server.root / f"run{time.monotonic_ns()}"
    LocalStore(str(run)).write("a/b/blob.bin", DATA)
    yield http_server, f"{http_server.url}/{run.name}"
    http_server.reset()


def gets(srv):
    return [r for r in srv.requests if r[0] == "GET"]


def test_http_read_and_ranges(http):
    srv, root = http
    store = open_store(root, backoff=0.01)
    assert isinstance(store, HttpStore)
    check_readable(store)
    ranged = [r for r in gets(srv) if "Range" in r[2]]
    assert ranged and all(r[2]["Range"].startswith("bytes=") for r in ranged)
    assert all(r[2]["Accept-Encoding"] == "identity" for r in gets(srv))  # ranges over stored bytes
    with pytest.raises(NotImplementedError):
        store.list()
    with pytest.raises(SourceError, match="read-only"):
        store.write("x", b"y")
    assert store.key_uri("a/b/blob.bin") == f"{root}/a/b/blob.bin"


def test_http_parallel_ranges_overlap(http):
    srv, root = http
    srv.delay = 0.2
    store = open_store(root)
    ranges = [(i * 1000, 1000) for i in range(8)]
    assert store.read_ranges("a/b/blob.bin", ranges, workers=8) == [DATA[s:s + n] for s, n in ranges]
    assert srv.max_inflight >= 4, srv.max_inflight


def test_http_server_ignoring_range(http):
    srv, root = http
    srv.honor_range = False
    store = open_store(root)
    assert store.read_range("a/b/blob.bin", 40_000, 1234) == DATA[40_000:41_234]
    assert store.read_ranges("a/b/blob.bin", [(0, 5), (99_000, 1_003)]) == [DATA[:5], DATA[99_000:]]
    with pytest.raises(IntegrityError):
        store.read_range("a/b/blob.bin", len(DATA) - 1, 2)


@pytest.mark.parametrize("status", [503, 429, 500])
def test_http_retries_then_succeeds(http, status):
    srv, root = http
    srv.fail_next, srv.fail_status = 2, status
    store = open_store(root, retries=3, backoff=0.01)
    assert store.read("a/b/blob.bin") == DATA
    assert len(gets(srv)) == 3  # two refused, the third served
    srv.fail_next = 2
    assert store.read_range("a/b/blob.bin", 7, 7) == DATA[7:14]


def test_http_retries_exhausted(http):
    srv, root = http
    srv.fail_next = 100
    store = open_store(root, retries=2, backoff=0.01)
    with pytest.raises(SourceError, match="503") as e:
        store.read("a/b/blob.bin")
    assert not isinstance(e.value, NotFoundError)
    assert len(gets(srv)) == 3  # first try + 2 retries


def test_http_reads_cut_mid_body_are_retried_then_reported(http):
    """A connection dropped half way through a body (whole object or range) is read again; past
    the retries it is a SourceError (502 on a server), never a short or spliced result."""
    srv, root = http
    store = open_store(root, retries=2, backoff=0.01)
    srv.cut_next = 2
    assert store.read("a/b/blob.bin") == DATA
    srv.cut_next = 1
    assert store.read_range("a/b/blob.bin", 1000, 50_000) == DATA[1000:51_000]
    srv.cut_next = 100
    with pytest.raises(SourceError, match="mid-body|Content-Length said") as e:
        store.read_range("a/b/blob.bin", 0, 60_000)
    assert not isinstance(e.value, IntegrityError)
    assert sum(1 for r in gets(srv) if r[2].get("Range") == "bytes=0-59999") == 3  # first try + 2 retries


def test_http_read_timeout_is_retried_then_reported(http):
    srv, root = http
    srv.delay = 1.0  # the server stalls longer than the read timeout on every request
    store = open_store(root, read_timeout=0.3, retries=1, backoff=0.01)
    with pytest.raises(SourceError, match="timed out"):
        store.read("a/b/blob.bin")
    assert len(gets(srv)) == 2  # first try + 1 retry
    srv.delay = 0.0


def test_http_connection_refused():
    store = open_store(f"http://127.0.0.1:{free_port()}/run", retries=1, backoff=0.01, connect_timeout=1)
    t = time.monotonic()
    with pytest.raises(SourceError, match="127.0.0.1"):
        store.read("LATEST")
    assert time.monotonic() - t < 10


def test_http_bearer_token(http):
    srv, root = http
    srv.require_token = "s3cret"
    with settings.override(http_token=None), pytest.raises(SourceError, match="access denied") as e:
        open_store(root).read("a/b/blob.bin")
    assert "s3cret" not in str(e.value)
    assert open_store(root, token="s3cret").read_range("a/b/blob.bin", 1, 2) == DATA[1:3]
    with settings.override(http_token="s3cret"):  # ENGINE_EXT_HTTP_TOKEN
        assert open_store(root).read("a/b/blob.bin") == DATA
    assert gets(srv)[-1][2]["Authorization"] == "Bearer s3cret"


def test_http_writable_put(http):
    srv, root = http
    srv.allow_put = True
    store = open_store(root, writable=True)
    store.write("new/obj.bin", DATA[:777])
    assert store.read("new/obj.bin") == DATA[:777]
    srv.allow_put = False
    with pytest.raises(SourceError, match="405"):
        store.write("new/obj.bin", b"x")


# --------------------------------------------------------------------------- S3


def test_s3_store(s3_server, s3_bucket):
    store = open_store(f"s3://{s3_bucket}/run1")  # endpoint from ENGINE_EXT_S3_ENDPOINT
    assert isinstance(store, S3Store) and store.endpoint_url == s3_server.endpoint_url
    check_writable(store)
    assert store.key_uri("LATEST") == f"s3://{s3_bucket}/run1/LATEST"
    other = open_store(f"s3://{s3_bucket}")  # bucket root: keys carry the run prefix
    assert other.read("run1/a/b/blob.bin") == DATA
    assert "run1/empty" in other.list()


def test_s3_list_paginates(s3_bucket):
    store = open_store(f"s3://{s3_bucket}/p")
    store.list_page_size = 2
    keys = [f"v{i:08d}.json" for i in range(7)]
    for k in keys:
        store.write(k, k.encode())
    store.write("LATEST", b"6")
    assert store.list("v") == keys
    assert store.list() == ["LATEST"] + keys


def test_s3_endpoint_option_and_env(s3_server, s3_bucket, monkeypatch):
    open_store(f"s3://{s3_bucket}/r").write("k", b"v")
    with settings.override(s3_endpoint=f"http://127.0.0.1:{free_port()}"):  # the option wins over ENGINE_EXT_S3_ENDPOINT
        store = open_store(f"s3://{s3_bucket}/r", endpoint_url=s3_server.endpoint_url)
        assert store.read("k") == b"v"
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    with settings.override(s3_endpoint=None):
        assert open_store(f"s3://{s3_bucket}/r").read("k") == b"v"


def test_s3_errors(s3_server, s3_bucket):
    with pytest.raises(SourceError, match="does not exist") as e:
        open_store("s3://no-such-bucket-here/run").read("LATEST")
    assert not isinstance(e.value, NotFoundError)  # misconfiguration, not "nothing published yet"
    dead = open_store(f"s3://{s3_bucket}/r", endpoint_url=f"http://127.0.0.1:{free_port()}",
                      retries=0, connect_timeout=1)
    with pytest.raises(SourceError, match="127.0.0.1"):
        dead.read("LATEST")


def test_s3_multipart_write_file(s3_bucket, tmp_path):
    big = random.Random(1).randbytes(11 << 20)
    src = tmp_path / "big.bin"
    src.write_bytes(big)
    store = open_store(f"s3://{s3_bucket}/run", multipart_threshold=5 << 20, multipart_chunksize=5 << 20)
    store.write_file("blob.bin", src)
    head = store.client.head_object(Bucket=s3_bucket, Key="run/blob.bin")
    assert head["ETag"].strip('"').endswith("-3")  # really uploaded in 3 parts
    assert store.read("blob.bin") == big
    ranges = [(i << 20, 1 << 20) for i in range(11)]
    assert b"".join(store.read_ranges("blob.bin", ranges, workers=8)) == big


# --------------------------------------------------------------------------- publishing


class CrashingStore:
    """Wraps a store; raises (as a killed publisher would stop) when writing ``crash_on``."""

    def __init__(self, inner, crash_on):
        self.inner, self.crash_on, self.written = inner, crash_on, []

    def _writer(self, name):
        def write(key, *args):
            if key == self.crash_on:
                raise RuntimeError(f"publisher died before writing {key}")
            getattr(self.inner, name)(key, *args)
            self.written.append(key)
        return write

    def __getattr__(self, name):
        if name in ("write", "write_file", "create", "create_file", "write_if"):
            return self._writer(name)
        return getattr(self.inner, name)


def latest(v: int, fingerprint: str = "0" * 16) -> bytes:
    return Latest(v, f"v{v:08d}.json", fingerprint).to_json()


def publish(store, v: int, blobs):
    return publish_version(store, blobs, f"v{v:08d}.json", b'{"v":%d}' % v, latest(v), v)


def held(store) -> int:
    return Latest.from_json(store.read("LATEST"))[0].version


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_publish_order_survives_crash(backend, tmp_path, request):
    if backend == "s3":
        store = open_store(f"s3://{request.getfixturevalue('s3_bucket')}/run")
    else:
        store = open_store(tmp_path / "run")
    assert publish(store, 1, {"v00000001.blob": b"one"}) == store.key_uri("v00000001.json")
    blobs = {"v00000002.0.blob": DATA, "v00000002.1.blob": DATA[::-1]}

    crashing = CrashingStore(store, crash_on="v00000002.json")  # dies after the blobs
    with pytest.raises(RuntimeError):
        publish(crashing, 2, blobs)
    assert sorted(crashing.written) == sorted([*blobs, "v00000002.claim"])  # the blobs, then the version's claim
    assert held(store) == 1 and not store.exists("v00000002.json")

    crashing = CrashingStore(store, crash_on="v00000003.1.blob")  # dies among the blobs
    with pytest.raises(RuntimeError):
        publish(crashing, 3, {"v00000003.0.blob": b"a", "v00000003.1.blob": b"b"})
    assert "v00000003.json" not in crashing.written and "LATEST" not in crashing.written
    assert held(store) == 1 and not store.exists("v00000003.json")

    src = tmp_path / "big.blob"
    src.write_bytes(DATA)
    uri = publish(store, 4, [("v00000004.0.blob", src), ("v00000004.1.blob", DATA[::-1])])
    assert uri == store.key_uri("v00000004.json")
    assert held(store) == 4 and store.read("v00000004.0.blob") == DATA


@pytest.mark.parametrize("backend", ["local", "s3", "http"])
def test_published_objects_are_written_once_and_latest_only_moves_forward(backend, tmp_path, request):
    """A version's blobs, signature and manifest are created, never replaced: a second publisher
    of the same version fails with ConflictError naming the version and the store, and changes no
    byte of what was published; LATEST is never moved back."""
    if backend == "s3":
        store = open_store(f"s3://{request.getfixturevalue('s3_bucket')}/run")
    elif backend == "http":
        srv = request.getfixturevalue("http_server")
        srv.reset()
        srv.allow_put = True
        store = HttpStore(f"{srv.url}/run-{tmp_path.name}", writable=True)
    else:
        store = open_store(tmp_path / "run")
    publish_version(store, {"v00000002.0.bin": b"first"}, "v00000002.json", b'{"v":2}', latest(2), 2,
                    signature=b"sig-1")
    before = {k: store.read(k) for k in ("v00000002.0.bin", "v00000002.json", "v00000002.json.sig", "LATEST")}
    for blobs, sig in (({"v00000002.0.bin": b"other"}, None), ({"v00000002.9.bin": b"x"}, b"sig-2"), ({}, None)):
        with pytest.raises(ConflictError, match=f"version 2 cannot be published to {re.escape(store.uri)}"):
            publish_version(store, blobs, "v00000002.json", b'{"v":"other"}', latest(2), 2, signature=sig)
    with pytest.raises(ConflictError, match="LATEST names v2, not older than v1"):
        publish_version(store, {}, "v00000001.json", b'{"v":1}', latest(1), 1)
    # same version, other weights, under the version's other manifest key (a racing publisher's anchor
    # beside the winner's delta): the version's claim refuses it before its manifest exists (chaos seed 1 found it)
    with pytest.raises(ConflictError, match="v2 is already claimed by other weights"):
        publish_version(store, {}, "v00000002.anchor.json", b'{"v":2}', latest(2, "1" * 16), 2)
    assert not store.exists("v00000002.anchor.json")
    assert {k: store.read(k) for k in before} == before
    publish_version(store, {}, "v00000002.anchor.json", b'{"v":2}', latest(2), 2)  # the same weights' anchor: taken
    assert store.read("v00000002.anchor.json") == b'{"v":2}' and held(store) == 2
    with pytest.raises(ConflictError):
        store.create("v00000002.json", b"again")
    store.write_if("LATEST", latest(3), lambda cur: None)
    assert held(store) == 3


def test_latest_compare_and_swap_holds_against_racing_processes(tmp_path):
    """Eight processes each try to move a local LATEST from the version they read to the next:
    every move that succeeds is seen by the next one (no update is lost under flock)."""
    store = open_store(tmp_path)
    store.write("LATEST", latest(0))
    script = textwrap.dedent("""
        import sys
        from engine_ext.errors import ConflictError
        from engine_ext.format.latest import Latest
        from engine_ext.store import open_store
        store, done = open_store(sys.argv[1]), 0
        for _ in range(25):
            cur = store.read("LATEST")
            v = Latest.from_json(cur)[0].version + 1
            def only_from(now, want=cur):
                if now != want:
                    raise ConflictError("moved")
            try:
                store.write_if("LATEST", Latest(v, "m", "0" * 16).to_json(), only_from)
                done += 1
            except ConflictError:
                pass
        print(done)
    """)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, env=env, text=True)
             for _ in range(8)]
    done = sum(int(p.communicate(timeout=120)[0]) for p in procs)
    assert held(store) == done > 0


def test_publish_rejects_clashing_keys(tmp_path):
    store = open_store(tmp_path)
    with pytest.raises(ValueError):
        publish_version(store, {"LATEST": b"x"}, "v1.json", b"{}", latest(1), 1)
    with pytest.raises(ValueError):
        publish_version(store, [("b", b"1"), ("b", b"2")], "v1.json", b"{}", latest(1), 1)
    assert os.listdir(tmp_path) == []


KILLED_PUBLISHER = textwrap.dedent("""
    import os, signal, sys
    from engine_ext.format.latest import Latest
    from engine_ext.store import open_store, publish_version
    root, die_at = sys.argv[1], sys.argv[2]
    def dying(real):
        def call(src, dst, *a, **kw):  # SIGKILL ourselves at the moment ``die_at`` would appear
            if os.path.basename(dst) == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(src, dst, *a, **kw)
        return call
    os.replace, os.link = dying(os.replace), dying(os.link)  # LATEST is replaced, the rest created (linked)
    publish_version(open_store(root), {"v00000002.blob": b"x" * 1_000_000}, "v00000002.json",
                    b'{"v":2}', Latest(2, "v00000002.json", "0" * 16).to_json(), 2)
""")


@pytest.mark.parametrize("die_at, manifest_visible", [("v00000002.json", False), ("LATEST", True)])
def test_publisher_sigkilled_midway(tmp_path, die_at, manifest_visible):
    """A real publisher process is SIGKILLed mid-write (data written and fsynced, rename
    not yet done): LATEST still names v1, v2's manifest appears only if complete."""
    store = open_store(tmp_path)
    publish(store, 1, {"v00000001.blob": b"one"})
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", KILLED_PUBLISHER, str(tmp_path), die_at], env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert held(store) == 1
    assert store.exists("v00000002.json") == manifest_visible
    assert store.read("v00000002.blob") == b"x" * 1_000_000  # blobs are complete before any manifest
    assert "LATEST" in store.list() and not any(".tmp" in k for k in store.list())
    hidden = [n for n in os.listdir(tmp_path) if n.startswith(".engine-ext-tmp-")]
    assert len(os.listdir(tmp_path)) == len(store.list()) + len(hidden)  # the dead writer's temp file, a lock file: unlisted


# --------------------------------------------------------------------------- URIs


@pytest.mark.parametrize("uri, cls, root, key", [
    ("/data/run1/v00000003.json", LocalStore, "/data/run1", "v00000003.json"),
    ("/LATEST", LocalStore, "/", "LATEST"),
    ("file:///data/run1/v00000003.json", LocalStore, "file:///data/run1", "v00000003.json"),
    ("http://127.0.0.1:8000/runs/run1/v00000003.json", HttpStore, "http://127.0.0.1:8000/runs/run1", "v00000003.json"),
    ("https://cdn.example/v%20x.json", HttpStore, "https://cdn.example", "v x.json"),
    ("s3://b/run1/v00000003.json", S3Store, "s3://b/run1", "v00000003.json"),
    ("s3://b/LATEST", S3Store, "s3://b", "LATEST"),
    ("hf://buckets/ns/name/run1/v00000003.json", HfBucketStore, "hf://buckets/ns/name/run1", "v00000003.json"),
    ("hf://buckets/ns/name/LATEST", HfBucketStore, "hf://buckets/ns/name", "LATEST"),
])
def test_split_uri(uri, cls, root, key):
    store, k = split_uri(uri)
    assert isinstance(store, cls) and store.uri == root and k == key
    assert store.key_uri(k) == uri  # split_uri inverts key_uri


def test_split_uri_relative_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store, key = split_uri("run/LATEST")
    assert store.uri == str(tmp_path / "run") and key == "LATEST"


@pytest.mark.parametrize("uri", ["s3://bucket", "s3://b/run/", "http://host", "hf://buckets/ns/x.json",
                                 "https://h/a?sig=1", "ftp://h/a/b", "hf://models/gpt2/config.json"])
def test_split_uri_refuses(uri):
    with pytest.raises(SourceError):
        split_uri(uri)


def test_open_store_unknown_option(tmp_path):
    with pytest.raises(TypeError):
        open_store(tmp_path, endpoint_url="http://x")


# --------------------------------------------------------------------------- Hugging Face


def test_hf_bucket_reads_over_http(http_server):
    """The Hub itself is unreachable here: serve the bucket-file URL layout that
    huggingface_hub 2.4's HfFileSystem uses (/buckets/<id>/resolve/<path>) from the local
    HTTP server. This checks our URL building, token and read path, not the Hub."""
    http_server.reset()
    LocalStore(str(http_server.root / "buckets/ns/name/resolve/run1")).write("v00000001.json", DATA)
    store = open_store("hf://buckets/ns/name/run1", endpoint=http_server.url, token="hf_test")
    assert store.uri == "hf://buckets/ns/name/run1"
    check_readable(store, key="v00000001.json")
    assert gets(http_server)[-1][2]["Authorization"] == "Bearer hf_test"
    with pytest.raises(NotFoundError, match="hf://buckets/ns/name/run1/missing"):
        store.read("missing")
