"""engine-ext: diff, apply, inspect and anchor safetensors checkpoints against a store; keygen; push a version to a fleet.

Publishing commands sign with ``--sign KEY`` (or ``ENGINE_EXT_SIGNING_KEY``); reading
commands verify with ``--trust PUBKEY`` (or ``ENGINE_EXT_TRUSTED_KEYS``) and read unsigned
versions only with ``--allow-unsigned`` (or ``ENGINE_EXT_ALLOW_UNSIGNED=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from tqdm import tqdm

from . import settings
from .errors import BaseMismatchError, DeltaError
from .format import codec
from .format import fingerprint as fpr
from .format.delta import apply_tensor, changed_bits
from .format.dtypes import as_bits, dtype_by_name, served_as, served_dtype, to_served
from .format.manifest import ANCHOR, DELTA
from .store import open_store, split_uri
from .store.checkpoint import INDEX_NAME, CheckpointDir, SafetensorsWriter
from .store.decoding import TensorBases
from .store.reader import load_cells, load_delta, read_link
from .store.signing import Signer, Trust, generate_key
from .trainer.builder import VersionBuilder
from .trainer.delta_pipeline import ContextBase, DeltaEncoder, TensorChange
from .trainer.lineage import read_head

# Optional packages a command imports, and the extra of pyproject.toml that installs each (tests/test_cli.py
# holds this to pyproject.toml): a command that needs one says which extra to install.
EXTRA_OF = {"matplotlib": "report", "boto3": "s3", "huggingface_hub": "hf"}


def _needs(module: str) -> None:
    """Raise the ModuleNotFoundError :func:`main` turns into 'pip install "engine-ext[X]"' when ``module`` is missing."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)


def _bar(items, desc, total=None):
    return tqdm(items, desc=desc, total=total, unit="tensor", file=sys.stderr, disable=None, leave=False)


def _signer(a) -> Signer | None:
    return Signer(a.sign) if a.sign else Signer.from_settings()


def _trust(a, publisher: Signer | None | bool = False) -> Trust:
    """``--trust`` (else ``ENGINE_EXT_TRUSTED_KEYS``); a publishing command (``publisher``: its
    signer, or None when it publishes unsigned) reading back its own store also trusts what it
    signed, or, unsigned, its own bytes."""
    s = settings.current()
    keys = a.trust or list(s.trusted_keys)
    unsigned_publisher = publisher is None
    trust = Trust.from_public_keys(
        keys,
        threshold=s.signature_threshold if not a.trust else 1,
        allow_unsigned=a.allow_unsigned or s.allow_unsigned or unsigned_publisher,
    )
    return trust.also_trusting(publisher) if isinstance(publisher, Signer) else trust


def _next_version(head, asked: int | None, at_least: int = 0) -> int:
    """``asked`` (refused at or below a version the store holds), else the first free version."""
    if asked is not None and asked < head.next_version:
        raise DeltaError(
            f"version {asked}: the store already holds versions up to v{head.next_version - 1}; "
            "version numbers only grow (leave --version out to take the next free one)"
        )
    return asked if asked is not None else max(head.next_version, at_least)


def _note(cmd: str, text: str) -> None:
    """What a publishing command did with the store it found (stderr: stdout ends with the URI)."""
    print(f"engine-ext {cmd}: {text}", file=sys.stderr)


def _checkpoint(cmd: str, path: str) -> CheckpointDir:
    """A checkpoint dir as published: without the tied copy its config.json says the engines skip."""
    ck = CheckpointDir(path)
    for copy, kept in ck.drop_tied_copies().items():
        _note(cmd, f"{path}: {copy} is tied to {kept} (config.json, same bytes): published once, as {kept}")
    return ck


def _loader(ck: CheckpointDir, dtype):
    """Read one tensor of ``ck`` in the served ``dtype`` (--dtype; None: as stored)."""
    return lambda name: to_served(ck.load(name), dtype)


def _tensor_change(name: str, load_old, load_new, dtype) -> TensorChange:
    """One tensor's changes from OLD to NEW (``dtype``: as served). Whether the context coder pays is
    asked while OLD's tensor is in memory: uniform changes then cost no step table and no second read
    of it; where it pays, the encode reads OLD's tensor again as the coder's base."""
    o, n = load_old(name), load_new(name)
    if o.shape != n.shape or o.dtype != n.dtype:
        raise DeltaError(f"{name}: {tuple(o.shape)}/{o.dtype} in old, {tuple(n.shape)}/{n.dtype} in new")
    old_bits = as_bits(o).reshape(-1)
    pos, old_at, new_at = changed_bits(old_bits, as_bits(n).reshape(-1))
    context = None
    if settings.current().context_coder:
        policy = codec.context_policy(name, dtype, n.shape, pos.numel())
        if policy is not None and codec.context_pays(dtype, old_bits, old_at):
            context = ContextBase(policy, lambda: as_bits(load_old(name)).reshape(-1), known_to_pay=True)
    return TensorChange(
        name, dtype, tuple(n.shape), pos, old_at, new_at, fpr.tensor_fingerprint(o), fpr.tensor_fingerprint(n), context
    )


def cmd_diff(a) -> str:
    old, new = _checkpoint("diff", a.old), _checkpoint("diff", a.new)
    dtype = served_dtype(a.dtype)
    load_old, load_new = _loader(old, dtype), _loader(new, dtype)
    if set(old.tensors) != set(new.tensors):
        raise DeltaError(
            f"the checkpoints hold different tensors: only in old {sorted(set(old.tensors) - set(new.tensors))[:5]}, "
            f"only in new {sorted(set(new.tensors) - set(old.tensors))[:5]}"
        )
    store = open_store(a.out)
    b = VersionBuilder(DELTA, a.model or Path(a.new).name, 0, spool_in=store)
    # the changes first: the version's step tables come from all of them
    changes = [
        _tensor_change(name, load_old, load_new, served_as(new.tensors[name].dtype, dtype))
        for name in _bar(new.names(), "diff")
    ]
    DeltaEncoder(a.mode).write(b, changes)
    old_fps = {c.name: c.base_fp for c in changes}
    signer = _signer(a)
    trust = _trust(a, signer)
    head = read_head(store, trust)
    latest, m = head.latest, b.manifest
    if (
        latest is not None
        and fpr.parse(latest.fingerprint) == fpr.model_fingerprint(old_fps)
        and a.base_version in (None, latest.version)
    ):
        m.base_version, m.anchor_version = latest.version, latest.anchor_version
        m.base_manifests = [latest.sha256 or read_link(store, latest.manifest, trust).sha256]
        how = f"a delta on top of the store's LATEST (v{latest.version}), bound to its manifest"
    else:
        m.base_version = a.base_version if a.base_version is not None else 0
        where = "an empty store" if latest is None else f"the store's LATEST is v{latest.version} with other weights"
        how = f"a delta from OLD as v{m.base_version}, bound to it by fingerprint only ({where})"
    m.version = _next_version(head, a.version, m.base_version + 1)
    _note("diff", f"v{m.version}: {how}")
    return b.publish(store, signer)


def cmd_anchor(a) -> str:
    ck = _checkpoint("anchor", a.checkpoint)
    dtype = served_dtype(a.dtype)
    store = open_store(a.out)
    signer = _signer(a)
    head = read_head(store, _trust(a, signer))
    version = _next_version(head, a.version)
    b = VersionBuilder(ANCHOR, a.model or Path(a.checkpoint).name, version, anchor_version=version, spool_in=store)
    infos = [(n, served_as(i.dtype, dtype), i.shape) for n, i in ck.tensors.items()]
    with _bar(None, "anchor", total=len(infos)) as bar:
        b.add_anchor(infos, _loader(ck, dtype), lambda _, t: fpr.tensor_fingerprint(t), bar.update)
    _note(
        "anchor",
        f"v{version}: an anchor"
        + ("" if head.latest is None else f", after the store's LATEST (v{head.latest.version})"),
    )
    return b.publish(store, signer)


class _LazyCheckpoint(Mapping):
    """A checkpoint's tensors by name, each read when first asked for (context-coded deltas read their base)."""

    def __init__(self, ckpt: CheckpointDir):
        self.ckpt = ckpt

    def __getitem__(self, name):
        if name not in self.ckpt.tensors:
            raise KeyError(name)
        return self.ckpt.load(name)

    def __iter__(self):
        return iter(self.ckpt.tensors)

    def __len__(self):
        return len(self.ckpt.tensors)


def cmd_apply(a) -> str:
    out = Path(a.out)
    if out.exists():
        raise DeltaError(f"{out} exists; refusing to overwrite it")
    base = _checkpoint("apply", a.base) if a.base else None
    bases = None if base is None else TensorBases(_LazyCheckpoint(base))
    d = load_delta(a.manifest, trust=_trust(a), bases=bases)
    by_name = {t.name: t for t in d.tensors}
    if base is None and d.kind != ANCHOR:
        raise DeltaError("a delta needs --base")
    if base is not None:
        extra = set(base.tensors) - set(d.tensor_fingerprints)
        missing = set(d.tensor_fingerprints) - set(base.tensors)
        if extra or missing:
            raise BaseMismatchError(
                f"base and manifest hold different tensors: only in base {sorted(extra)[:5]}, only in manifest {sorted(missing)[:5]}"
            )
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent if str(out.parent) else "."))
    try:
        if base is not None:
            layout = {f: [(n, i.dtype, i.shape) for n, i in base.tensors.items() if i.file == f] for f in base.files}
            for p in base.path.iterdir():  # config, tokenizer, index: copied as they are (less a tied copy left out)
                if p.name == INDEX_NAME:
                    index = json.loads(p.read_text())
                    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if n in base.tensors}
                    (tmp / p.name).write_text(json.dumps(index, indent=2))
                elif p.is_file() and not p.name.endswith(".safetensors"):
                    shutil.copy2(p, tmp / p.name)
        else:
            layout = {"model.safetensors": [(t.name, t.dtype, t.shape) for t in d.tensors]}
        with _bar(None, "apply", total=sum(len(v) for v in layout.values())) as bar:
            for fname, infos in layout.items():
                w = SafetensorsWriter(tmp / fname, infos)
                for name, dt, shape in infos:
                    t = base.load(name) if base is not None else None
                    if t is not None and d.kind != ANCHOR:
                        fp = fpr.tensor_fingerprint(t)
                        if fp != d.tensor_base_fingerprints[name]:
                            raise BaseMismatchError(
                                f"{name}: base fingerprint {fpr.fmt(fp)}, the delta applies to {fpr.fmt(d.tensor_base_fingerprints[name])} (wrong base)"
                            )
                    td = by_name.get(name)
                    if td is not None:
                        t = apply_tensor(None if d.kind == ANCHOR else t, td)
                    elif fpr.tensor_fingerprint(t) != d.tensor_fingerprints[name]:
                        raise BaseMismatchError(f"{name}: unchanged tensor differs from the version's fingerprint")
                    w.write(name, t)
                    bar.update()
                w.close()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(out)


def cmd_inspect(a) -> str:
    store, key = split_uri(a.manifest)
    link = read_link(store, key, _trust(a))
    m = link.manifest
    load_cells(store, m)  # tables (format 7, 10): each cut tensor's cells, so that every part's coder shows
    rows, by_enc, coders = [], {}, {}
    changed = numel = 0
    for t in m.tensors:
        numel += t.numel
        changed += t.nnz
        if not t.nnz:
            continue
        rows.append(t)
        mix = coders.setdefault(t.name, {})
        for p in t.chunks or [t]:  # every part: the whole tensor, or each of its cells
            e = by_enc.setdefault(f"positions:{p.positions.coder}", [0, 0])
            e[0] += p.nnz
            e[1] += p.positions.length
            e = by_enc.setdefault(f"values:{p.values.mode}-{p.values.coder}", [0, 0])
            e[0] += p.nnz
            e[1] += p.values.length
            enc = f"{p.positions.coder}+{p.values.mode}-{p.values.coder}"
            mix[enc] = mix.get(enc, 0) + 1
    dense = sum(t.numel * dtype_by_name(t.dtype).itemsize for t in m.tensors)
    if a.json:
        return json.dumps(
            {
                "kind": m.kind,
                "model": m.model,
                "base_version": m.base_version,
                "version": m.version,
                "signatures": link.signed,
                "sha256": link.sha256,
                "tensors": len(m.tensors),
                "changed_tensors": len(rows),
                "elements": numel,
                "changed_elements": changed,
                "payload_bytes": m.payload_bytes,
                "dense_bytes": dense,
                "bytes_per_changed_element": {k: v[1] / v[0] for k, v in by_enc.items()},
                "parts_by_encoding": {t: mix for t, mix in coders.items()},
            }
        )
    lines = [
        (
            f"{m.kind} {m.model}: version {m.base_version} -> {m.version} (anchor {m.anchor_version}); "
            f"{f'signed by {link.signed} trusted key(s)' if link.signed else 'UNSIGNED'}, sha256 {link.sha256[:16]}"
        ),
        f"fingerprint {m.base_fingerprint} -> {m.fingerprint}",
        (
            f"tensors {len(m.tensors)} ({len(rows)} changed), elements {numel:,}, changed {changed:,} "
            f"({100 * changed / max(numel, 1):.3f} %)"
        ),
        f"payload {m.payload_bytes:,} B in {len(m.blobs)} blob(s); dense {dense:,} B; ratio {dense / max(m.payload_bytes, 1):.1f}x",
        "bytes per changed element by encoding:",
    ]
    lines += [f"  {k:24s} {v[1] / max(v[0], 1):8.3f}  ({v[1]:,} B)" for k, v in sorted(by_enc.items())]
    lines.append(f"{'tensor':60s} {'dtype':9s} {'density':>8s} {'bytes':>10s} {'B/elem':>7s}  encoding")
    rows.sort(key=lambda t: -sum(p.length for p in t.chunks or [t]))
    for t in rows if a.all else rows[:20]:
        size = sum(p.length for p in t.chunks or [t])
        mix = coders[t.name]
        lines.append(
            f"{t.name[:60]:60s} {t.dtype:9s} {100 * t.nnz / t.numel:7.3f}% {size:10,d} {size / t.nnz:7.3f}  "
            + ", ".join(enc if len(mix) == 1 and not t.chunks else f"{enc} x{n}" for enc, n in sorted(mix.items()))
        )
    if len(rows) > 20 and not a.all:
        lines.append(f"... {len(rows) - 20} more changed tensors (--all)")
    return "\n".join(lines)


def cmd_keygen(a) -> str:
    kid = generate_key(a.out)
    return f"key {kid}: private {a.out} (keep it secret; ENGINE_EXT_SIGNING_KEY), public {a.out}.pub (ENGINE_EXT_TRUSTED_KEYS)"


class PushFailed(Exception):
    """Some replicas did not reach the version (the table is still printed)."""


def _token(a) -> str | None:
    """The update routes' token: ``--token-file``, else ``ENGINE_EXT_TOKEN``; ``--token`` (deprecated: argv
    is visible to every user of the machine through ``ps``) still works, with a warning."""
    if getattr(a, "token", None) is not None:
        print(
            f"engine-ext {a.cmd}: warning: --token is deprecated (the command line is visible in ps); "
            "use ENGINE_EXT_TOKEN or --token-file",
            file=sys.stderr,
        )
        return a.token
    if getattr(a, "token_file", None):
        return Path(a.token_file).read_text().strip()
    return settings.current().token


def cmd_push(a) -> str:
    from .fleet import Fleet

    urls = [u.strip() for u in ",".join(a.servers).split(",") if u.strip()]
    res = Fleet(urls, _token(a), retries=a.retries, timeout_s=a.timeout).update(
        a.uri, rollback=a.rollback, progress=not a.json
    )
    out = json.dumps(res.to_json(), indent=1) if a.json else f"target v{res.target}\n{res.table()}"
    if not res.ok:
        names = ", ".join(r.url for r in res.failed)
        print(out)
        raise PushFailed(f"{len(res.failed)} of {len(res.replicas)} replica(s) did not reach v{res.target}: {names}")
    return out


def cmd_compact(a) -> str:
    from .store.reader import read_latest
    from .trainer.catch_up import check_spans, publish_catch_ups

    spans = check_spans(int(x) for x in a.spans.split(","))
    store = open_store(a.store)
    signer = _signer(a)
    trust = _trust(a, signer)
    last = a.to if a.to is not None else read_latest(store, trust).version
    first = a.since if a.since is not None else last
    lines = []
    for version in range(first, last + 1):
        for c in publish_catch_ups(store, version, spans, trust=trust, signer=signer):
            what = f"skipped: {c.skipped}" if c.skipped else f"{c.key}: {c.payload_bytes} bytes"
            lines.append(f"v{c.base_version} -> v{c.version} ({c.parts} links, {c.parts_bytes} bytes): {what}")
    return (
        "\n".join(lines) or f"no catch-up delta of spans {list(spans)} ends in v{first}..v{last} that is not published"
    )


def cmd_report(a) -> str:
    _needs("matplotlib")  # before the chain is replayed, not after: the page's plots are drawn with it
    from . import report

    store = open_store(a.store)
    keys = a.trust or list(settings.current().trusted_keys)
    trust = Trust.from_public_keys(keys, allow_unsigned=not keys or a.allow_unsigned)
    rows = report.collect(store, trust, bound=not a.no_bound)
    if not rows:
        raise DeltaError(f"{store.uri}: no versions to report")
    reps = []
    if a.servers:
        urls = [u.strip() for u in ",".join(a.servers).split(",") if u.strip()]
        reps = report.replicas(urls, _token(a), max(r.version for r in rows))
    path = report.render(report.Report(store.uri, rows, reps, verified=bool(keys)), a.out)
    return f"{len(rows)} version(s) of {store.uri}: {path}"


EXAMPLES = """examples:
  engine-ext keygen publisher.key
  engine-ext anchor ./ckpt-step0 --out s3://bucket/run1 --dtype bfloat16
  engine-ext diff ./ckpt-step0 ./ckpt-step1 --out s3://bucket/run1 --dtype bfloat16
  engine-ext inspect s3://bucket/run1/v00000001.json --trust publisher.key.pub
  engine-ext apply s3://bucket/run1/v00000001.json --base ./ckpt-step0 --out ./ckpt-step1-rebuilt
  engine-ext report s3://bucket/run1 --out ./report --trust publisher.key.pub --servers http://rollout-0:8000
  ENGINE_EXT_TOKEN=... engine-ext push s3://bucket/run1 --servers http://rollout-0:8000,http://rollout-1:8000

environment: ENGINE_EXT_SIGNING_KEY (publishing commands sign with it), ENGINE_EXT_TRUSTED_KEYS (reading
commands verify with it), ENGINE_EXT_TOKEN (push), ENGINE_EXT_S3_ENDPOINT, ENGINE_EXT_HTTP_TOKEN; every
variable: docs/settings.md."""


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option's help (pip's and vLLM's convention), descriptions kept as written."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("engine-ext")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="engine-ext", description=__doc__.replace("``", ""), epilog=EXAMPLES, formatter_class=_Help
    )
    p.add_argument("--version", action="version", version=f"engine-ext {_version()}")
    p.add_argument("--debug", action="store_true", help="on an error, print the traceback too")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name, help):
        q = sub.add_parser(name, help=help, description=help, formatter_class=_Help)
        q.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="on an error, print the traceback too"
        )
        return q

    def trusts(q):
        q.add_argument(
            "--trust",
            action="append",
            metavar="PUBKEY",
            help="trusted Ed25519 public key (PEM file or 64 hex digits), repeatable "
            "(default: ENGINE_EXT_TRUSTED_KEYS)",
        )
        q.add_argument("--allow-unsigned", action="store_true", help="read unsigned versions (trust the store)")

    def signs(q):
        """How a publishing command signs what it writes (diff, anchor, compact), and whom it trusts reading back."""
        q.add_argument(
            "--sign",
            action="append",
            metavar="KEY",
            help="Ed25519 private key (PEM) to sign with, repeatable (default: ENGINE_EXT_SIGNING_KEY)",
        )
        trusts(q)

    def publishes(q):
        """The options of the commands that publish a version (diff, anchor): what it is, how it is signed."""
        q.add_argument("--model", help="model identity written into the manifest (default: the checkpoint's name)")
        q.add_argument(
            "--dtype",
            choices=["bfloat16", "float16", "float32"],
            help="served dtype to cast floating-point tensors (16 bits and wider) to before publishing "
            "(default: as stored: a checkpoint dir already holds the dtype it is served in)",
        )
        signs(q)

    k = command("keygen", "make an Ed25519 signing key (OUT) and its public key (OUT.pub)")
    k.add_argument("out", metavar="OUT", help="path of the private key to write (OUT.pub gets the public key)")
    k.set_defaults(fn=cmd_keygen)
    d = command("diff", "publish the delta between two checkpoint directories")
    d.add_argument("old", metavar="OLD", help="checkpoint directory of the base version")
    d.add_argument("new", metavar="NEW", help="checkpoint directory of the new version")
    d.add_argument(
        "--out", required=True, metavar="STORE", help="store root: path, file://, http(s)://, s3://bucket/prefix"
    )
    d.add_argument("--base-version", type=int, help="version of OLD (default: the store's LATEST if it is OLD, else 0)")
    d.add_argument("--version", type=int, help="version of NEW (default: the first free version, at least base + 1)")
    d.add_argument("--mode", choices=["abs", "rel"], help="force a value mode (default: the smaller per tensor)")
    publishes(d)
    d.set_defaults(fn=cmd_diff)
    an = command("anchor", "publish a full anchor of a checkpoint directory")
    an.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint directory to publish whole")
    an.add_argument(
        "--out", required=True, metavar="STORE", help="store root: path, file://, http(s)://, s3://bucket/prefix"
    )
    an.add_argument(
        "--version", type=int, help="version to publish (default: 0 on an empty store, else the first free version)"
    )
    publishes(an)
    an.set_defaults(fn=cmd_anchor)
    ap = command("apply", "materialise the checkpoint a manifest produces")
    ap.add_argument("manifest", metavar="MANIFEST", help="manifest URI of the version to materialise")
    ap.add_argument("--base", help="checkpoint directory the delta applies to (not needed for an anchor)")
    ap.add_argument("--out", required=True, help="new directory (must not exist)")
    trusts(ap)
    ap.set_defaults(fn=cmd_apply)
    i = command("inspect", "summarise a manifest")
    i.add_argument("manifest", metavar="MANIFEST", help="manifest URI (a store's vNNNNNNNN[.anchor].json)")
    i.add_argument("--all", action="store_true", help="list every tensor, not only the largest changes")
    i.add_argument("--json", action="store_true", help="print the summary as JSON")
    trusts(i)
    i.set_defaults(fn=cmd_inspect)
    pu = command(
        "push", "update every replica to a version, concurrently; non-zero exit naming any that did not get there"
    )
    pu.add_argument("uri", metavar="URI", help="manifest URI (or a store root: its LATEST) as the servers see it")
    pu.add_argument("--servers", action="append", required=True, help="server base URLs, comma-separated (repeatable)")
    pu.add_argument(
        "--token-file", metavar="PATH", help="file holding the servers' update-route token (default: ENGINE_EXT_TOKEN)"
    )
    pu.add_argument("--token", help=argparse.SUPPRESS)  # deprecated: visible in ps (a warning says so)
    pu.add_argument("--retries", type=int, default=4, help="extra attempts per replica for transient failures")
    pu.add_argument("--timeout", type=float, default=900.0, help="seconds one attempt may take")
    pu.add_argument("--rollback", action="store_true", help="allow an older version (an explicit rollback)")
    pu.add_argument("--json", action="store_true", help="print the result as JSON (no progress bar)")
    pu.set_defaults(fn=cmd_push)
    cp = command(
        "compact",
        "publish catch-up deltas: one signed delta over several versions, for replicas that lag "
        "(composed from the store's deltas; LATEST unchanged)",
    )
    cp.add_argument("store", metavar="STORE", help="store root: path, file://, http(s)://, s3://bucket/prefix")
    cp.add_argument(
        "--spans", default="4,16,64", help="spans in versions, powers of two (a span s ends at multiples of s)"
    )
    cp.add_argument("--since", type=int, help="first version to end catch-ups at (default: the last)")
    cp.add_argument("--to", type=int, help="last version to end catch-ups at (default: the store's LATEST)")
    signs(cp)
    cp.set_defaults(fn=cmd_compact)
    rp = command(
        "report", "write one self-contained HTML page of a run: per version what changed, where, and what it cost"
    )
    rp.add_argument("store", metavar="STORE", help="store root: path, file://, http(s)://, s3://bucket/prefix")
    rp.add_argument("--out", required=True, metavar="DIR", help="directory to write index.html into")
    rp.add_argument(
        "--servers",
        action="append",
        help="replicas' base URLs, comma-separated (repeatable): their version, lag, last update",
    )
    rp.add_argument(
        "--token-file", metavar="PATH", help="file holding the replicas' route token (default: ENGINE_EXT_TOKEN)"
    )
    rp.add_argument(
        "--no-bound",
        action="store_true",
        help="read the manifests only (the first-order bound replays the chain in memory: the whole model, once)",
    )
    trusts(rp)
    rp.set_defaults(fn=cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    """Every error is one line on stderr and a non-zero exit (1; 130 for Ctrl-C); ``--debug`` adds the traceback."""
    a = build_parser().parse_args(argv)
    try:
        print(a.fn(a))
    except KeyboardInterrupt:
        print(f"engine-ext {a.cmd}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as e:  # an optional package: name the extra that installs it
        if a.debug:
            import traceback

            traceback.print_exc()
        top = (e.name or "").split(".")[0]
        hint = f'pip install "engine-ext[{EXTRA_OF[top]}]"' if top in EXTRA_OF else f"pip install {top}"
        print(
            f"engine-ext {a.cmd}: error: this command needs the package {top!r}, which is not installed: {hint}",
            file=sys.stderr,
        )
        return 1
    except Exception as e:  # noqa: BLE001 - one line for the user; the traceback with --debug
        if a.debug:
            import traceback

            traceback.print_exc()
        expected = isinstance(e, (DeltaError, ValueError, OSError, PushFailed))
        what = str(e) if expected else f"{type(e).__name__}: {e}"
        print(
            f"engine-ext {a.cmd}: error: {' '.join(what.split())}"
            + ("" if expected or a.debug else " (--debug shows the traceback)"),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
