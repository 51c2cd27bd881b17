#!/usr/bin/env python3
"""A week of faults in minutes: the chaos soak, with invariants checked while it runs.

    python stress/chaos.py --seed 7 --minutes 15 --out /tmp/chaos            # the documented soak
    python stress/chaos.py --seed 1 --minutes 1.5 --stores http --replicas followed,pushed   # CI (tests/test_chaos.py)

Every part is real and on loopback: a trainer process publishing signed versions of a
tiny Qwen2 (an RL-like trajectory, its own checkpoint every few steps, as a trainer keeps),
vLLM CPU servers with the plugin (``followed``: pull mode; ``pushed``: the harness pushes
every new ``LATEST``; ``tp2``: pushed, at tensor parallelism 2), a client sending
completions to every replica all the time, and the stores in turn: a local directory (on a
small tmpfs where the host lets us mount one, so that it can fill up), the HTTP test server
(PUT for the publisher) and moto's S3, the last two behind TCP proxies the harness owns.

Faults, at random from the seed, several at once: the publisher SIGKILLed and restarted
from its checkpoint, a second publisher started beside a running one, a server or a
single rank SIGKILLed and restarted, the store answering 503, cutting reads half way or
reading slowly (through a proxy), a follower partitioned from its store for a while, a
full disk under a local store, and a ``LATEST`` left to go stale (the publisher dead past
the pointer's expiry).

Invariants, checked continuously (each violation is reported with the time and the seed
that replays the run):

- a replica only ever serves a fingerprint some published version has (never a mix): its
  status, and every ~10 s its live weights re-read by every rank (``?audit=1``);
- each replica's version only moves forward (within one incarnation; the harness never asks
  for a rollback);
- no published object ever changes its bytes, and a store's ``LATEST`` never moves back;
- requests fail only while their own server is down (killed, or restarting);
- after the faults stop, every replica reaches ``LATEST`` within ``--converge-s`` and then
  equals a server cold-started on ``LATEST``'s weights (fingerprint, live audit, greedy
  tokens and logprobs).

The report (``report.json`` and ``report.md`` under ``--out``) gives the versions
published, the faults injected by kind, requests served and failed, the longest
convergence, and every violation. Exit status 0 only without violations.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

PROMPT = [5, 17, 99, 3, 250]  # > 4 tokens (AMX hosts: docs/vllm.md, "Known vLLM CPU issues")
OUTPUT_PROMPTS = [[5, 17, 99, 3, 250], [100, 200, 300, 7, 9], [9, 9, 9, 9, 9, 9]]
STORE_KINDS = ("local", "http", "s3")
ROLES = ("followed", "pushed", "tp2")


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ============================================================================ the trainer process


def publisher_main(args) -> int:
    """``chaos.py publish``: a trainer that publishes a version every ``--interval`` s and keeps
    its own checkpoint every 3 versions; resumes from that checkpoint when restarted (so a
    restarted trainer may hold weights older than LATEST: the store decides delta or anchor)."""
    import torch

    from engine_ext.errors import ConflictError, SourceError
    from engine_ext.store.http import HttpStore
    from engine_ext.tiny_models import load_state_dict
    from engine_ext.trainer.publisher import DeltaPublisher

    ckpt = Path(args.ckpt) / "trainer.pt"
    if ckpt.exists():
        state = torch.load(ckpt)
        master, step = state["master"], state["step"]
    else:
        master, step = {n: t.float() for n, t in load_state_dict(args.model).items()}, 0
    store = HttpStore(args.store, writable=True) if args.store.startswith("http") else args.store
    events = open(args.events, "a", buffering=1)

    def event(**kw):
        events.write(json.dumps({"t": time.time(), "pid": os.getpid(), **kw}) + "\n")

    try:
        pub = DeltaPublisher(store, model="chaos", anchor_every=args.anchor_every, latest_ttl_s=args.ttl, workers=1)
    except SourceError as e:  # the store is down as the trainer starts: it exits, its orchestrator restarts it
        event(what="unreachable", error=str(e)[:300])
        return 4
    if args.start_version is not None and pub.head.latest is None:  # a new store: the fleet's versions continue
        pub.next_version = max(pub.next_version, args.start_version)
    event(what="start", step=step, next_version=pub.next_version)
    hold = Path(args.ckpt) / "hold"  # the harness's "training has ended": no more versions, LATEST kept fresh
    while True:
        if hold.exists():
            time.sleep(0.5)
            continue
        step += 1
        g = torch.Generator().manual_seed(args.seed * 100_003 + step)  # the trajectory is a function of the step
        for t in master.values():
            t.add_(torch.randn(t.shape, generator=g) * 2e-3 * (t.abs().mean() + 1e-3))
        try:
            uri = pub.publish({n: t.to(torch.bfloat16) for n, t in master.items()})
            pub.wait()
            event(what="published", version=pub.version, uri=uri, fingerprint=f"{pub.fingerprint:016x}")
        except ConflictError as e:  # another trainer owns the store now: this one stops
            event(what="conflict", error=str(e)[:300])
            return 3
        except RuntimeError as e:  # the store refused a write: the next version starts a new chain
            event(what="error", error=str(e)[:300])
        if step % 3 == 0:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"master": master, "step": step}, tmp)
            os.replace(tmp, ckpt)
        time.sleep(args.interval)


# ============================================================================ a TCP proxy with faults


class Proxy:
    """A TCP proxy on loopback in front of an HTTP store. Modes: ``pass``; ``refuse`` (close every
    connection at once); ``blackhole`` (accept, never answer: a partition); ``http503`` (answer
    each new connection's request with 503 and close); ``cut`` (stop an answer after a few hundred
    bytes and hang up); ``slow`` (answers trickle). A new mode closes the open connections, so it
    bites at once."""

    def __init__(self, upstream: tuple[str, int], name: str):
        self.upstream, self.name, self.mode = upstream, name, "pass"
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._conns: set = set()
        self._lock = threading.Lock()
        self._stop = False
        threading.Thread(target=self._accept, name=f"proxy-{name}", daemon=True).start()

    def set(self, mode: str) -> None:
        with self._lock:
            self.mode = mode
            conns, self._conns = list(self._conns), set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.close()

    def close(self) -> None:
        self._stop = True
        self.set("refuse")
        with contextlib.suppress(OSError):
            self.sock.close()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _track(self, *socks) -> None:
        with self._lock:
            self._conns.update(socks)

    def _serve(self, client: socket.socket) -> None:
        mode = self.mode
        self._track(client)
        try:
            if mode == "refuse":
                return
            if mode == "blackhole":
                client.settimeout(120)
                while client.recv(65536):
                    pass
                return
            if mode == "http503":
                client.settimeout(10)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = client.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                client.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            up = socket.create_connection(self.upstream, timeout=10)
            self._track(up)
            budget = random.randint(200, 4000) if mode == "cut" else None
            self._pump(client, up, budget, slow=(mode == "slow"))
        except (OSError, ValueError):  # a socket closed under us by a change of mode
            pass
        finally:
            for s in (client,):
                with contextlib.suppress(OSError):
                    s.close()

    def _pump(self, client, up, budget, slow) -> None:
        try:
            while True:
                r, _, _ = select.select([client, up], [], [], 30)
                if not r:
                    return
                for s in r:
                    data = s.recv(4096 if slow else 65536)
                    if not data:
                        return
                    if s is up:
                        if budget is not None:
                            data = data[:budget]
                            budget -= len(data)
                        if slow:
                            time.sleep(0.05)
                        client.sendall(data)
                        if budget is not None and budget <= 0:
                            return  # the answer stops half way: the connection is dropped
                    else:
                        up.sendall(data)
        finally:
            with contextlib.suppress(OSError):
                up.close()


# ============================================================================ stores


@dataclasses.dataclass
class Site:
    """One store kind: where the publisher writes (``write_uri``), what pushed replicas and the
    follower read (through their own proxies for HTTP and S3), and a direct way to list and read
    every object for the invariant checks (never through a proxy)."""

    kind: str
    write_uri: str
    read_uri: str  # pushed replicas
    follow_uri: str  # the followed replica
    env_pub: dict
    env_read: dict
    env_follow: dict
    objects: callable  # () -> {key: bytes}
    proxies: dict = dataclasses.field(default_factory=dict)  # "writer" / "reader" / "follower" -> Proxy
    ballast: Path | None = None  # a local store on a tmpfs: filling this fills the disk

    def sources(self) -> list[str]:
        return sorted({self.read_uri, self.follow_uri, self.write_uri})


class Stores:
    """Starts the three store kinds once (the tmpfs, the HTTP server, moto) and tears them down."""

    def __init__(self, work: Path, kinds, stack: contextlib.ExitStack):
        self.work, self.sites = work, {}
        for kind in kinds:
            self.sites[kind] = getattr(self, f"_{kind}")(stack)

    def _local(self, stack) -> Site:
        mnt = self.work / "local-store"
        mnt.mkdir(parents=True, exist_ok=True)
        tmpfs = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192m", "tmpfs", str(mnt)], capture_output=True).returncode == 0
        if tmpfs:
            stack.callback(lambda: subprocess.run(["umount", "-l", str(mnt)], capture_output=True))
        run = mnt / "run"
        run.mkdir(exist_ok=True)

        def objects():
            return {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and not p.name.startswith(".")}

        return Site("local", str(run), str(run), str(run), {}, {}, {}, objects, ballast=(mnt / ".ballast") if tmpfs else None)

    def _http(self, stack) -> Site:
        from servers import serve_http

        root = self.work / "http-root"
        (root / "run").mkdir(parents=True)
        srv = stack.enter_context(serve_http(root))
        srv.allow_put = True
        port = int(srv.url.rsplit(":", 1)[1])
        proxies = {n: Proxy(("127.0.0.1", port), f"http-{n}") for n in ("writer", "reader", "follower")}
        for p in proxies.values():
            stack.callback(p.close)
        run = root / "run"

        def objects():
            return {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and not p.name.startswith(".")}

        return Site("http", f"{proxies['writer'].url}/run", f"{proxies['reader'].url}/run", f"{proxies['follower'].url}/run",
                    {}, {}, {}, objects, proxies)

    def _s3(self, stack) -> Site:
        import boto3
        from servers import serve_s3

        srv = stack.enter_context(serve_s3())
        bucket = srv.make_bucket("chaos")
        port = int(srv.endpoint_url.rsplit(":", 1)[1])
        proxies = {n: Proxy(("127.0.0.1", port), f"s3-{n}") for n in ("writer", "reader", "follower")}
        for p in proxies.values():
            stack.callback(p.close)
        s3 = boto3.client("s3", endpoint_url=srv.endpoint_url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")

        def objects():
            out = {}
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="run/"):
                for o in page.get("Contents", []):
                    out[o["Key"][4:]] = s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
            return out

        env = lambda p: {**srv.env, "ENGINE_EXT_S3_ENDPOINT": p.url}  # noqa: E731
        uri = f"s3://{bucket}/run"
        return Site("s3", uri, uri, uri, env(proxies["writer"]), env(proxies["reader"]), env(proxies["follower"]),
                    objects, proxies)


# ============================================================================ replicas and load


@dataclasses.dataclass
class Replica:
    role: str
    server: object = None  # a VllmServer
    incarnation: int = 0
    down: list = dataclasses.field(default_factory=list)  # [start, end] windows while it was killed or restarting
    version: int | None = None  # the last version seen in this incarnation
    served: int = 0
    failed: int = 0
    failed_while_down: int = 0
    starting: bool = True
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def is_down(self, t0: float, t1: float, grace: float = 2.0) -> bool:
        return self.starting or any(a - grace <= t1 and (b is None or t0 <= b + grace) for a, b in self.down)


class Soak:
    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.rng = random.Random(args.seed)
        self.violations: list[dict] = []
        self.faults: dict[str, int] = {}
        self.t0 = time.time()
        self.known_fps: dict[str, int] = {}  # fingerprint -> version (every store)
        self.hashes: dict[tuple, str] = {}  # (store, key) -> SHA-256
        self.latest: dict[str, int] = {}  # store -> LATEST's version
        self.latest_key: dict[str, str] = {}  # store -> the manifest LATEST names
        self.replicas: dict[str, Replica] = {}
        self.publishers: list[subprocess.Popen] = []
        self.site = None
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.scan_lock = threading.Lock()  # one store scan at a time (scan_stores)
        self.pushed_version = None
        self.convergence: dict[str, float] = {}
        self.crashed: set[int] = set()
        self.startup_failures: list[dict] = []  # restarts that failed their warm-up and were restarted again
        self.deck: list[str] = []
        self.servers: list = []

    # ---- invariant bookkeeping
    def violate(self, what: str, **detail) -> None:
        v = {"t": round(time.time() - self.t0, 1), "what": what, "seed": self.args.seed, **detail}
        with self.lock:
            self.violations.append(v)
        log(f"VIOLATION {v}")

    def fault(self, kind: str) -> None:
        with self.lock:
            self.faults[kind] = self.faults.get(kind, 0) + 1
        log(f"fault: {kind}")

    # ---- the trainer
    def start_publisher(self, site) -> subprocess.Popen:
        env = {**os.environ, **site.env_pub, "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, __file__, "publish", "--store", site.write_uri, "--model", str(self.model),
               "--ckpt", str(self.ckpt), "--seed", str(self.args.seed), "--interval", str(self.args.interval),
               "--ttl", str(self.args.ttl), "--events", str(self.work / "events.jsonl")]
        self.scan_stores()
        if site.kind not in self.latest and self.latest:  # a new store: its versions continue the fleet's
            cmd += ["--start-version", str(max(self.latest.values()) + 1)]
        logf = open(self.work / f"publisher-{len(self.publishers)}.log", "w")
        p = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        self.publishers.append(p)
        return p

    def live_publishers(self) -> list[subprocess.Popen]:
        return [p for p in self.publishers if p.poll() is None]

    def kill(self, p: subprocess.Popen) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()

    # ---- replicas
    def start_replica(self, role: str) -> None:
        from engine_ext.engines.vllm.launcher import VllmServer

        rep = self.replicas.setdefault(role, Replica(role))
        env = {"ENGINE_EXT_FETCH_TIMEOUT": "60", "ENGINE_EXT_FOLLOW_INTERVAL": "1"}
        for st in self.stores.sites.values():  # S3's endpoint: this replica's proxy, whichever store is current
            env.update(st.env_follow if role == "followed" else st.env_read)
        if role == "followed":
            env["ENGINE_EXT_FOLLOW"] = self.site.follow_uri
        tp = 2 if role == "tp2" else 1
        if tp == 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(ROLES.index(role) % (os.cpu_count() or 1))
        sources = ",".join(s for st in self.stores.sites.values() for s in st.sources())
        with rep.lock:
            rep.starting, rep.incarnation, rep.version = True, rep.incarnation + 1, None
        # no base version: the server knows its weights by fingerprint (each store's v0 is another checkpoint)
        rep.server = VllmServer(self.model, sources=sources, tp=tp, env=env, token=self.token, trusted_keys=self.pubkey,
                                log=self.work / f"{role}-{rep.incarnation}.log", startup_s=600)
        self.servers.append(rep.server)  # every server ever started is stopped at the end, whatever happened
        rep.server.complete(PROMPT, max_tokens=1, logprobs=0)  # warm-up (> 4 tokens)
        with rep.lock:
            rep.starting = False
            if rep.down and rep.down[-1][1] is None:
                rep.down[-1][1] = time.time()
        log(f"replica {role} up (incarnation {rep.incarnation}, tp {tp})")

    def restart_replica(self, role: str, how: str = "server") -> None:
        rep = self.replicas[role]
        with rep.lock:  # one restart of a replica at a time (two faults may pick the same one)
            if rep.starting and how != "planned":
                return
            rep.down.append([time.time(), None])
            rep.starting = True
        srv = rep.server
        if how == "rank":  # one worker of a TP replica: the engine dies with it
            workers = _children(srv.proc.pid, "VllmWorker")
            target = workers[-1] if workers else srv.proc.pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, signal.SIGKILL)
            time.sleep(3)
        srv.stop() if how == "planned" else _killpg(srv.proc)
        srv.stop()
        for attempt in range(1, 4):  # a server that fails its readiness (the warm-up) is restarted, as an orchestrator's probe would
            try:
                self.start_replica(role)
                return
            except Exception as e:  # noqa: BLE001
                if attempt == 3 or self.stop.is_set():
                    raise
                failed = rep.server
                log(f"replica {role} incarnation {rep.incarnation} failed its warm-up ({type(e).__name__}: {str(e)[:160]}); "
                    f"restarting it (log {failed.log_path if failed else '-'})")
                self.startup_failures.append({"replica": role, "incarnation": rep.incarnation, "error": str(e)[:300],
                                              "log": str(failed.log_path) if failed else None})
                if failed is not None:
                    _killpg(failed.proc)
                    failed.stop()

    # ---- background checks
    def load_loop(self, role: str) -> None:
        import requests

        rep = self.replicas[role]
        while not self.stop.is_set():
            srv = rep.server
            if srv is None or rep.starting:
                time.sleep(0.2)
                continue
            t0 = time.time()
            try:
                r = requests.post(srv.url + "/v1/completions", timeout=120, json={
                    "model": srv.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
                ok = r.status_code == 200
                err = None if ok else f"HTTP {r.status_code} {r.text[:200]}"
            except Exception as e:  # noqa: BLE001
                ok, err = False, f"{type(e).__name__}: {str(e)[:200]}"
            t1 = time.time()
            with rep.lock:
                if ok:
                    rep.served += 1
                elif rep.is_down(t0, t1) or srv is not rep.server or self.stop.is_set():  # stopping: servers go down
                    rep.failed_while_down += 1
                else:
                    rep.failed += 1
                    self.violate("a request failed while its server was up", replica=role, error=err)
            time.sleep(0.4)

    def scan_stores(self) -> None:
        """Read every store and check its objects against what earlier scans saw. One scan at a time:
        the watch loop, the fault threads (starting a publisher) and the convergence phase all scan, and
        a scan that read LATEST before another read a newer one must not compare after it."""
        with self.scan_lock:
            self._scan_stores()

    def _scan_stores(self) -> None:
        from engine_ext.format.latest import Latest
        from engine_ext.format.manifest import Manifest

        for name, site in self.stores.sites.items():
            try:
                objs = site.objects()
            except Exception as e:  # noqa: BLE001 - a store mid-fault; the next scan reads it
                log(f"scan of {name} failed: {e}")
                continue
            for key, data in objs.items():
                h = hashlib.sha256(data).hexdigest()
                if key == "LATEST":
                    lt, _ = Latest.from_json(data)
                    if lt.version < self.latest.get(name, -1):
                        self.violate("LATEST moved back", store=name, was=self.latest[name], now=lt.version)
                    elif lt.version > self.latest.get(name, -1):
                        self.latest[name], self.latest_key[name] = lt.version, lt.manifest
                    continue
                if not key.startswith("v"):
                    continue
                old = self.hashes.setdefault((name, key), h)
                if old != h:
                    self.violate("a published object changed its bytes", store=name, key=key)
                if key.endswith(".json") and (name, key, "fp") not in self.hashes:
                    m = Manifest.from_json(data)
                    self.known_fps[m.fingerprint] = m.version
                    self.hashes[(name, key, "fp")] = m.fingerprint

    def watch_loop(self) -> None:
        import requests

        last_audit: dict[str, float] = {}
        while not self.stop.is_set():
            self.scan_stores()
            for role, rep in list(self.replicas.items()):
                srv, inc = rep.server, rep.incarnation
                if srv is None or rep.starting:
                    continue
                audit = time.time() - last_audit.get(role, 0) > 10
                try:
                    r = requests.get(srv.url + "/update_weights_delta" + ("?audit=1" if audit else ""),
                                     headers={"Authorization": f"Bearer {srv.token}"}, timeout=60)
                    st = r.json() if r.status_code == 200 else None
                except Exception:  # noqa: BLE001 - a server killed under us; the load loop judges requests
                    st = None
                if st is None or rep.starting or inc != rep.incarnation:
                    continue
                if audit:
                    last_audit[role] = time.time()
                    if not st["audit"]["ok"]:
                        self.violate("the live weights differ from the served state", replica=role, audit=st["audit"])
                fp, version = st["fingerprint"], st["version"]
                if fp not in self.known_fps and fp != self.v0_fp:
                    self.scan_stores()
                    if fp not in self.known_fps:
                        self.violate("served a fingerprint no published version has", replica=role, fingerprint=fp,
                                     version=version)
                if version is not None:
                    if rep.version is not None and version < rep.version:
                        self.violate("a replica's version moved back", replica=role, was=rep.version, now=version)
                    rep.version = version if rep.version is None else max(rep.version, version)
            time.sleep(0.5)

    def push_loop(self) -> None:
        """Push every new LATEST of the current store to the pushed replicas (as a trainer's Fleet would)."""

        while not self.stop.is_set():
            self.push_once(retries=1)
            time.sleep(1.0)

    def push_once(self, retries: int) -> bool:
        from engine_ext.fleet import Fleet

        site, key = self.site, self.latest_key.get(self.site.kind)
        targets = [r for role, r in self.replicas.items() if role != "followed" and not r.starting and r.server]
        if key is None or not targets:
            return False
        uri = f"{site.read_uri}/{key}"
        res = Fleet([r.server.url for r in targets], self.token, retries=retries, backoff_s=0.5, timeout_s=120).update(uri)
        return res.ok

    # ---- faults
    def fault_kinds(self) -> list[str]:
        kinds = ["kill_publisher", "racing_publisher", "kill_server", "stale_latest"]
        if "tp2" in self.replicas:
            kinds.append("kill_rank")
        if self.site.proxies:
            kinds += ["store_5xx", "store_cut", "store_slow", "partition"]
        if self.site.ballast is not None:
            kinds.append("disk_full")
        return kinds

    def deal(self) -> str:
        """The next fault from a shuffled deck of the kinds that apply (every kind once before any twice),
        so that a short run still meets each of them."""
        kinds = self.fault_kinds()
        self.deck = [k for k in self.deck if k in kinds]
        if not self.deck:
            self.deck = kinds[:]
            self.rng.shuffle(self.deck)
        return self.deck.pop()

    def run_fault(self, kind: str) -> None:
        rng, site = self.rng, self.site
        role = None
        if kind in ("kill_server", "kill_rank"):  # one restart of a replica at a time: pick among those up
            up = sorted(r for r, x in self.replicas.items() if not x.starting)
            role = ("tp2" if "tp2" in up else None) if kind == "kill_rank" else (rng.choice(up) if up else None)
            if role is None:
                return
        self.fault(kind)
        if kind == "kill_publisher":
            for p in self.live_publishers():
                self.kill(p)
            time.sleep(rng.uniform(1, 6))
            self.start_publisher(site)
        elif kind == "racing_publisher":  # a replacement trainer while the old one still runs
            self.start_publisher(site)
        elif kind == "stale_latest":  # nobody re-signs LATEST past its expiry
            for p in self.live_publishers():
                self.kill(p)
            time.sleep(self.args.ttl + 4)
            self.start_publisher(site)
        elif kind in ("kill_server", "kill_rank"):
            self.restart_replica(role, "rank" if kind == "kill_rank" else "server")
        elif kind in ("store_5xx", "store_cut", "store_slow", "partition"):
            which = "follower" if kind == "partition" else rng.choice(sorted(site.proxies))
            mode = {"store_5xx": "http503", "store_cut": "cut", "store_slow": "slow",
                    "partition": rng.choice(["blackhole", "refuse"])}[kind]
            site.proxies[which].set(mode)
            time.sleep(rng.uniform(*(self.args.partition_s if kind == "partition" else (3, 10))))
            site.proxies[which].set("pass")
        elif kind == "disk_full":
            _fill(site.ballast)
            time.sleep(rng.uniform(4, 12))
            site.ballast.unlink(missing_ok=True)

    def fault_loop(self, until: float) -> None:
        running: list[threading.Thread] = []
        while time.time() < until:
            time.sleep(self.rng.uniform(*self.args.gap_s))
            running = [t for t in running if t.is_alive()]
            self.check_publishers(restarting=any(t.is_alive() and t.name.endswith(("publisher", "latest"))
                                                 for t in running))
            if len(running) >= 2 or time.time() >= until:
                continue
            kind = self.deal()
            t = threading.Thread(target=self._guarded, args=(kind,), daemon=True, name=f"fault-{kind}")
            t.start()
            running.append(t)
        self.check_publishers(any(t.is_alive() for t in running))
        for t in running:
            t.join(600)

    def check_publishers(self, restarting: bool) -> None:
        """A publisher exits only when it lost a race (status 3) or the harness killed it; anything
        else is a crash. None left and no fault about to start one: start one."""
        for p in self.publishers:  # 3: lost a race; 4: the store was down as it started (restarted below)
            if p.poll() not in (None, 3, 4, -9) and p.pid not in self.crashed:
                self.crashed.add(p.pid)
                self.violate("a publisher crashed", pid=p.pid, status=p.returncode)
        if not restarting and not self.live_publishers():
            self.start_publisher(self.site)

    def _guarded(self, kind: str) -> None:
        try:
            self.run_fault(kind)
        except Exception as e:  # noqa: BLE001 - a fault that could not be injected is reported, not a violation
            log(f"fault {kind} could not complete: {type(e).__name__}: {e}")
            self.faults[f"{kind}_failed"] = self.faults.get(f"{kind}_failed", 0) + 1

    # ---- the run
    def run(self) -> dict:
        from engine_ext.format import fingerprint as fpr
        from engine_ext.store.signing import generate_key
        from engine_ext.tiny_models import load_state_dict, make_model

        args, work = self.args, self.work
        generate_key(str(work / "publisher.key"))
        self.pubkey, self.token = str(work / "publisher.key.pub"), "chaos-token"
        os.environ.update({"ENGINE_EXT_SIGNING_KEY": str(work / "publisher.key"), "ENGINE_EXT_TRUSTED_KEYS": self.pubkey,
                           "ENGINE_EXT_TOKEN": self.token})
        self.model = make_model(work / "model", "qwen2")
        self.v0_fp = fpr.fmt(fpr.model_fingerprint({n: fpr.tensor_fingerprint(t)
                                                      for n, t in load_state_dict(self.model).items()}))
        with contextlib.ExitStack() as stack:
            self.stores = Stores(work, args.stores, stack)
            stack.callback(self._teardown)
            phase_s = args.minutes * 60 / len(args.stores)
            threads = []
            for i, kind in enumerate(args.stores):
                self.site = self.stores.sites[kind]
                self.ckpt = work / "trainer"  # one trainer for the whole soak: it moves from store to store
                self.ckpt.mkdir(exist_ok=True)
                (self.ckpt / "hold").unlink(missing_ok=True)
                log(f"phase {i + 1}/{len(args.stores)}: store {kind} ({self.site.write_uri})")
                for p in self.live_publishers():
                    self.kill(p)
                self.start_publisher(self.site)
                starting = {role: (self.start_replica, (role,)) for role in args.replicas if role not in self.replicas}
                if "followed" in self.replicas:  # it follows the new store: a planned restart
                    starting["followed"] = (self.restart_replica, ("followed", "planned"))
                _all_or_raise(starting)
                if not threads:
                    threads = [threading.Thread(target=self.load_loop, args=(r,), daemon=True) for r in args.replicas]
                    threads += [threading.Thread(target=self.watch_loop, daemon=True),
                                threading.Thread(target=self.push_loop, daemon=True)]
                    for t in threads:
                        t.start()
                self.fault_loop(time.time() + phase_s)
            self.check_publishers(restarting=False)
            self.converge()
            for t in threads:
                t.join(130)
            return self.report()

    def converge(self) -> None:
        """The faults have stopped: one more version, then the publisher stops (LATEST is final); every
        replica must reach it within the bound and then equal a cold start on it."""
        from engine_ext.engines.vllm.launcher import VllmServer
        from engine_ext.errors import DeltaError
        from engine_ext.store import open_store
        from engine_ext.store.signing import Trust
        from engine_ext.tiny_models import save_state_dict
        from engine_ext.trainer import lineage

        site = self.site
        for p in site.proxies.values():
            p.set("pass")
        if site.ballast is not None:
            site.ballast.unlink(missing_ok=True)
        self.scan_stores()
        want = self.latest.get(site.kind, -1) + 1
        deadline = time.time() + 120
        while self.latest.get(site.kind, -1) < want and time.time() < deadline:
            time.sleep(0.5)
            self.scan_stores()
        (self.ckpt / "hold").touch()  # training ends: no more versions; the publisher keeps LATEST fresh
        time.sleep(self.args.interval + 2)
        self.scan_stores()
        final = self.latest.get(site.kind)
        t_final = time.time()
        log(f"faults stopped; LATEST of {site.kind} is v{final}")
        pending = set(self.replicas)
        bound = t_final + self.args.converge_s
        while pending and time.time() < bound:
            self.push_once(retries=2)
            for role in sorted(pending):
                rep = self.replicas[role]
                if rep.starting:
                    continue
                with contextlib.suppress(Exception):
                    if rep.server.status()["version"] == final:
                        self.convergence[role] = round(time.time() - t_final, 1)
                        pending.discard(role)
            time.sleep(1)
        for role in sorted(pending):
            self.violate("a replica did not reach LATEST within the bound", replica=role, bound_s=self.args.converge_s,
                         latest=final, status=_short_status(self.replicas[role].server))
        trust = Trust.from_public_keys([self.pubkey])
        try:
            with _env(site.env_read):
                latest = lineage.read_head(open_store(site.read_uri), trust).latest
                weights = lineage.rebuild(open_store(site.read_uri), latest, trust).weights
        except DeltaError as e:
            self.violate("LATEST's weights cannot be rebuilt from the store", store=site.kind, error=str(e)[:300])
            return
        self.stop.set()  # no more load: what each replica serves at LATEST is read, then they stop
        served = {role: (requests_status(rep.server, audit=True), _outputs(rep.server))
                  for role, rep in self.replicas.items() if role not in pending}
        self._teardown()
        cold_dir = save_state_dict(self.work / "cold", weights, self.model)
        cold = {}  # tensor-parallel size -> (fingerprint, outputs) of a server cold-started on LATEST's weights
        for tp in sorted({2 if role == "tp2" else 1 for role in served}):  # TP 2 reduces in another order than TP 1
            with VllmServer(cold_dir, tp=tp, log=self.work / f"cold-tp{tp}.log", token=self.token,
                            trusted_keys=self.pubkey) as srv:
                srv.complete(PROMPT, max_tokens=1, logprobs=0)
                cold[tp] = (srv.status()["fingerprint"], _outputs(srv))
        self.final = {"version": final, "fingerprint": cold[min(cold)][0] if cold else None}
        for role, (st, out) in served.items():
            want_fp, want_out = cold[2 if role == "tp2" else 1]
            if st["fingerprint"] != want_fp or not st["audit"]["ok"] or st["audit"]["fingerprint"] != want_fp:
                self.violate("a replica at LATEST differs from a cold start", replica=role, status=st.get("audit"))
            elif out != want_out:
                self.violate("a replica's outputs differ from a cold start at its tensor-parallel size", replica=role)

    def _teardown(self) -> None:
        self.stop.set()  # the load stops first: a request to a server stopped here is no violation
        for p in self.publishers:
            if p.poll() is None:
                self.kill(p)
        for srv in self.servers:
            srv.stop()

    def report(self) -> dict:
        reps = {r: {"served": x.served, "failed_while_up": x.failed, "failed_while_down": x.failed_while_down,
                    "incarnations": x.incarnation, "converged_s": self.convergence.get(r)} for r, x in self.replicas.items()}
        events = [json.loads(line) for line in (self.work / "events.jsonl").read_text().splitlines()] \
            if (self.work / "events.jsonl").exists() else []
        out = {
            "seed": self.args.seed, "minutes": self.args.minutes, "stores": list(self.args.stores),
            "replicas": list(self.args.replicas), "wall_s": round(time.time() - self.t0, 1),
            "versions_published": sum(e["what"] == "published" for e in events),
            "publish_errors": sum(e["what"] == "error" for e in events),
            "publishers_lost_race": sum(e["what"] == "conflict" for e in events),
            "publishers_store_down_at_start": sum(e["what"] == "unreachable" for e in events),
            "latest": self.latest, "faults": dict(sorted(self.faults.items())), "requests": reps,
            "longest_convergence_s": max(self.convergence.values(), default=None), "converge_bound_s": self.args.converge_s,
            "final": getattr(self, "final", None), "startup_failures": self.startup_failures,
            "violations": self.violations,
        }
        (self.work / "report.json").write_text(json.dumps(out, indent=1))
        (self.work / "report.md").write_text(_markdown(out))
        return out


# ============================================================================ helpers


def _children(pid: int, marker: str) -> list[int]:
    """PIDs of the descendants of ``pid`` whose command line or name contains ``marker``."""
    out, todo = [], [pid]
    procs = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (d / "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                name = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace") + stat
                procs[int(d.name)] = (ppid, name)
    while todo:
        p = todo.pop()
        for c, (ppid, name) in procs.items():
            if ppid == p:
                todo.append(c)
                if marker in name:
                    out.append(c)
    return sorted(out)


def _all_or_raise(jobs: dict) -> None:
    """Run ``{name: (fn, args)}`` in threads at once; raise the first failure (a replica that cannot start)."""
    errors = {}

    def one(name, fn, args):
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001
            errors[name] = e

    threads = [threading.Thread(target=one, args=(n, f, a)) for n, (f, a) in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        name, e = next(iter(errors.items()))
        raise RuntimeError(f"{name}: {type(e).__name__}: {e}") from e


def _killpg(proc) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _fill(path: Path) -> None:
    """Fill the filesystem ``path`` lies on (a tmpfs) until writes fail with ENOSPC."""
    with open(path, "wb") as f:
        block = b"\0" * (1 << 20)
        with contextlib.suppress(OSError):
            while True:
                f.write(block)
                f.flush()


@contextlib.contextmanager
def _env(extra: dict):
    from engine_ext import settings

    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        with settings.override(s3_endpoint=extra["ENGINE_EXT_S3_ENDPOINT"]) if "ENGINE_EXT_S3_ENDPOINT" in extra \
                else contextlib.nullcontext():
            yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def requests_status(server, audit: bool = False) -> dict:
    import requests

    r = requests.get(server.url + "/update_weights_delta" + ("?audit=1" if audit else ""),
                     headers={"Authorization": f"Bearer {server.token}"}, timeout=120)
    r.raise_for_status()
    return r.json()


def _short_status(server) -> dict:
    try:
        st = requests_status(server)
        return {"version": st["version"], "follow": st.get("follow"), "last": (st.get("history") or [None])[-1]}
    except Exception as e:  # noqa: BLE001
        return {"error": str(e)[:200]}


def _outputs(server) -> list:
    out = []
    for p in OUTPUT_PROMPTS:
        c = server.complete(p, max_tokens=8, logprobs=2)["choices"][0]
        out.append((c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]))
    return out


def _markdown(r: dict) -> str:
    lines = [f"# Chaos soak: seed {r['seed']}, {r['minutes']} min of faults, stores {', '.join(r['stores'])}, "
             f"replicas {', '.join(r['replicas'])}", "",
             f"- wall time {r['wall_s']} s; versions published {r['versions_published']} "
             f"(publish errors {r['publish_errors']}, publishers that lost a race {r['publishers_lost_race']}); "
             f"LATEST per store {r['latest']}",
             f"- longest convergence after the faults stopped: {r['longest_convergence_s']} s (bound {r['converge_bound_s']} s); "
             f"final {r['final']}",
             f"- servers restarted again after failing their warm-up (an orchestrator's readiness probe): "
             f"{len(r.get('startup_failures', []))}",
             f"- violations: **{len(r['violations'])}**", "", "| fault | injected |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in r["faults"].items()]
    lines += ["", "| replica | requests served | failed while up | failed while down | incarnations | converged (s) |",
              "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {k} | {v['served']} | {v['failed_while_up']} | {v['failed_while_down']} | {v['incarnations']} | "
              f"{v['converged_s']} |" for k, v in r["requests"].items()]
    if r["violations"]:
        lines += ["", "## Violations (replay with the same seed)", ""] + [f"- {json.dumps(v)}" for v in r["violations"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "publish":
        ap = argparse.ArgumentParser()
        ap.add_argument("cmd")
        for a in ("--store", "--model", "--ckpt", "--events"):
            ap.add_argument(a, required=True)
        ap.add_argument("--seed", type=int, default=0)
        ap.add_argument("--interval", type=float, default=2.0)
        ap.add_argument("--ttl", type=float, default=20.0)
        ap.add_argument("--anchor-every", type=int, default=6)
        ap.add_argument("--start-version", type=int, default=None, help="on an empty store (a fleet moved to a new one)")
        return publisher_main(ap.parse_args())
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--minutes", type=float, default=15.0, help="of faults (the set-up and convergence come on top)")
    ap.add_argument("--stores", default="local,http,s3", help="store kinds, each a phase of the faults, in order")
    ap.add_argument("--replicas", default="followed,pushed,tp2")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between the trainer's versions")
    ap.add_argument("--ttl", type=float, default=20.0, help="LATEST's expiry (the publisher re-signs it every ttl/4)")
    ap.add_argument("--converge-s", type=float, default=120.0, help="bound: every replica at LATEST after the faults stop")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.stores = [s for s in args.stores.split(",") if s]
    args.replicas = [r for r in args.replicas.split(",") if r]
    if set(args.stores) - set(STORE_KINDS) or set(args.replicas) - set(ROLES):
        ap.error(f"stores from {STORE_KINDS}, replicas from {ROLES}")
    short = args.minutes <= 3
    args.gap_s = (2.0, 6.0) if short else (4.0, 15.0)
    args.partition_s = (8.0, 20.0) if short else (15.0, 60.0)
    work = Path(args.out or tempfile.mkdtemp(prefix="engine_ext_chaos_"))
    work.mkdir(parents=True, exist_ok=True)
    log(f"seed {args.seed}, {args.minutes} min, stores {args.stores}, replicas {args.replicas}, out {work}")
    report = Soak(args, work).run()
    print(_markdown(report))
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
