"""``engine-ext report STORE --out DIR``: a run's story as one self-contained HTML page.

What changes, where and how much, version by version, read from the store's manifests (verified
against the trusted keys when any are given: ``--trust`` or ``ENGINE_EXT_TRUSTED_KEYS``; else read
as unsigned data, and the page says so):

* per version: kind, share of elements changed, stored bytes against the dense model, bytes per
  change against the first-order bound (the empirical entropy of the gaps plus that of the
  ordered-space steps, pooled over the version: what a coder without context could reach), and
  the coder mix (parts per positions coder);
* a heat map of the share changed per layer (``model.layers.N``; other tensors by their first
  name components) across versions: where RL touches the model;
* with ``servers``: each replica's version, its lag behind the store's newest, and its last update
  time, from its ``GET /update_weights_delta``.

The bound needs every change decoded, context-coded parts against their base, so the report
replays the chain from the first anchor in memory (the whole model, once, on the CPU); ``bound``
False reads the manifests alone. Plots are matplotlib PNGs inlined as data URIs: the page needs
no network and no other file.
"""

from __future__ import annotations

import base64
import html
import io
import math
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .fleet import Fleet
from .format.dtypes import as_bits, dtype_by_name, step_between
from .format.manifest import ANCHOR, Chunk, TensorEntry
from .store.base import Store
from .store.decoding import TensorBases
from .store.reader import decode_manifest, fetch_blobs, load_cells, read_link
from .store.signing import Trust


@dataclass
class VersionRow:
    """One published version, as the page shows it."""

    version: int
    kind: str
    numel: int
    changed: int
    stored_bytes: int
    dense_bytes: int
    coders: dict[str, int]  # positions coder -> parts
    groups: dict[str, float]  # layer or tensor group -> share of its elements changed
    signed: int
    bound_bytes: float | None = None  # first-order bound of the change set (deltas, when decoded)

    @property
    def share(self) -> float:
        return self.changed / max(self.numel, 1)

    @property
    def bytes_per_change(self) -> float | None:
        return self.stored_bytes / self.changed if self.kind != ANCHOR and self.changed else None

    @property
    def bound_per_change(self) -> float | None:
        return self.bound_bytes / self.changed if self.bound_bytes is not None and self.changed else None


@dataclass
class ReplicaRow:
    url: str
    version: int | None
    lag: int | None
    last_update: float | None
    error: str | None = None


@dataclass
class Report:
    store: str
    rows: list[VersionRow]
    replicas: list[ReplicaRow] = field(default_factory=list)
    verified: bool = False


def group_of(name: str) -> str:
    """``model.layers.N.*`` -> ``layer N``; others -> their name without the last component (``model.embed_tokens``)."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    if m:
        return f"layer {int(m.group(1)):03d}"
    return name.rsplit(".", 1)[0] if "." in name else name


def entropy_bits(x: np.ndarray) -> float:
    """The total first-order (empirical) entropy of a sequence, in bits."""
    if x.size == 0:
        return 0.0
    _, counts = np.unique(x, return_counts=True)
    p = counts / counts.sum()
    return float(-(counts * np.log2(p)).sum())


MANIFEST_KEY = re.compile(r"v\d{8}(?:\.anchor)?\.json")


def manifest_keys(store: Store) -> list[str]:
    """Every version's manifest key (anchors and deltas), by version (an anchor before a delta of its version)."""
    keys = [k for k in store.list("v") if MANIFEST_KEY.fullmatch(k)]
    return sorted(keys, key=lambda k: (int(k[1:9]), not k.endswith(f".{ANCHOR}.json")))


def collect(store: Store, trust: Trust, bound: bool = True) -> list[VersionRow]:
    """The rows of every version in ``store``, each manifest verified by ``trust``."""
    rows: list[VersionRow] = []
    bases: TensorBases | None = None  # the weights each delta applies to, known from the first anchor on
    for key in manifest_keys(store):
        link = read_link(store, key, trust)
        m = link.manifest
        load_cells(store, m)
        numel = changed = dense = 0
        coders: Counter = Counter()
        per_group: dict[str, list[int]] = {}
        for t in m.tensors:
            n = math.prod(t.shape)
            numel += n
            changed += t.nnz
            dense += n * dtype_by_name(t.dtype).itemsize
            g = per_group.setdefault(group_of(t.name), [0, 0])
            g[0] += t.nnz
            g[1] += n
            parts: Sequence[TensorEntry | Chunk] = t.chunks or [t]  # a cut tensor's cells, or the whole tensor
            for part in parts:
                if part.positions.coder != "none":
                    coders[part.positions.coder] += 1
        row = VersionRow(
            m.version,
            m.kind,
            numel,
            changed,
            m.payload_bytes,
            dense,
            dict(coders),
            {g: c / max(n, 1) for g, (c, n) in sorted(per_group.items())},
            link.signed,
        )
        if bound and (m.kind == ANCHOR or bases is not None):
            tensors = decode_manifest(m, fetch_blobs(store, m), bases=bases)
            if m.kind == ANCHOR or bases is None:
                bases = TensorBases({})
            else:
                row.bound_bytes = _bound_bytes(tensors, bases)
            bases.advance(tensors)
        rows.append(row)
    return rows


def _bound_bytes(tensors, bases: TensorBases) -> float:
    """First-order bound of a delta's changes: entropy of every gap plus every ordered-space step, in bytes."""
    gaps, steps = [], []
    for td in tensors:
        if td.positions is None and td.values.numel() == 0:
            continue
        index = td.index()  # every element where the delta is dense (positions None)
        pos = index.numpy()
        if pos.size == 0:
            continue
        gaps.append(np.diff(pos, prepend=0))
        values = td.values
        if td.mode != "rel":  # absolute bits: the step from the base's bits at those positions
            base = as_bits(bases.tensors[td.name].contiguous()).reshape(-1)[index]
            values = step_between(base, td.values, td.dtype.is_float)
        steps.append(values.numpy().astype(np.int64))
    if not gaps:
        return 0.0
    return (entropy_bits(np.concatenate(gaps)) + entropy_bits(np.concatenate(steps))) / 8


def replicas(urls: list[str], token: str | None, newest: int | None) -> list[ReplicaRow]:
    """Each replica's served version, lag and last update time (its ``GET /update_weights_delta``)."""
    fleet = Fleet(urls, token, retries=0)
    out = []
    for url in fleet.urls:
        st = fleet.status(url)
        if st is None:
            out.append(
                ReplicaRow(url, None, None, None, "no answer (down, or not running the plugin, or a wrong token)")
            )
            continue
        v = st.get("version")
        times = [h.get("time") for h in st.get("history") or [] if h.get("ok") and h.get("time")]
        out.append(
            ReplicaRow(url, v, None if v is None or newest is None else newest - v, max(times) if times else None)
        )
    return out


# -- the page ---------------------------------------------------------------------------------


def _or_nan(x: float | None) -> float:
    """A missing figure as a gap in a plotted line."""
    return np.nan if x is None else x


def _label(ax, ylabel: str) -> None:
    """A per-version plot's axes: versions as whole numbers on x, ``ylabel`` on y, its legend and a light grid."""
    from matplotlib.ticker import MaxNLocator  # matplotlib: the optional [report] extra

    ax.set_xlabel("version")
    ax.set_ylabel(ylabel)
    ax.legend()
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt  # the optional [report] extra

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _plots(rows: list[VersionRow]) -> dict[str, str]:
    import matplotlib  # the optional [report] extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    deltas = [r for r in rows if r.kind != ANCHOR]
    out = {}
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.semilogy([r.version for r in rows], [r.stored_bytes for r in rows], "o-", label="stored")
    ax.semilogy([r.version for r in rows], [r.dense_bytes for r in rows], "--", label="dense model")
    _label(ax, "bytes")
    out["bytes"] = _png(fig)
    if deltas:
        fig, ax = plt.subplots(figsize=(8, 3.2))
        ax.plot(
            [r.version for r in deltas],
            [_or_nan(r.bytes_per_change) for r in deltas],
            "o-",
            label="stored bytes per change",
        )
        if any(r.bound_per_change is not None for r in deltas):
            ax.plot(
                [r.version for r in deltas],
                [_or_nan(r.bound_per_change) for r in deltas],
                "s--",
                label="first-order bound",
            )
        _label(ax, "bytes per change")
        out["per_change"] = _png(fig)
        groups = sorted({g for r in deltas for g in r.groups})
        grid = np.array([[r.groups.get(g, np.nan) * 100 for r in deltas] for g in groups])
        fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(deltas) + 3), max(3, 0.28 * len(groups) + 1)))
        im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_xticks(range(len(deltas)), [str(r.version) for r in deltas])
        ax.set_yticks(range(len(groups)), groups)
        ax.set_xlabel("version")
        fig.colorbar(im, ax=ax, label="% of elements changed")
        out["heatmap"] = _png(fig)
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:,.3f}"


def render(report: Report, out_dir: str | Path) -> Path:
    """Write ``out_dir/index.html`` (created if needed); returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = _plots(report.rows)
    e = html.escape
    rows = []
    for r in report.rows:
        bpc = "" if r.bytes_per_change is None else f"{r.bytes_per_change:.3f}"
        bound = "" if r.bound_per_change is None else f"{r.bound_per_change:.3f}"
        coders = ", ".join(f"{c} {n}" for c, n in sorted(r.coders.items()))
        rows.append(
            f"<tr data-version='{r.version}' data-kind='{r.kind}'><td>{r.version}</td><td>{r.kind}</td>"
            f"<td class='share'>{r.share * 100:.3f} %</td><td class='stored'>{r.stored_bytes}</td>"
            f"<td>{_mib(r.stored_bytes)}</td><td>{_mib(r.dense_bytes)}</td>"
            f"<td>{r.dense_bytes / max(r.stored_bytes, 1):.1f}x</td><td>{bpc}</td><td>{bound}</td>"
            f"<td>{e(coders)}</td><td>{r.signed}</td></tr>"
        )
    reps = "".join(
        f"<tr><td>{e(x.url)}</td><td>{'' if x.version is None else x.version}</td><td>{'' if x.lag is None else x.lag}</td>"
        f"<td>{'' if x.last_update is None else time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(x.last_update))}</td>"
        f"<td>{e(x.error or '')}</td></tr>"
        for x in report.replicas
    )
    imgs = "".join(
        f"<h2>{e(t)}</h2><img id='{k}' alt='{e(t)}' src='{plots[k]}'>"
        for k, t in (
            ("bytes", "Stored bytes per version"),
            ("per_change", "Bytes per change"),
            ("heatmap", "Share changed per layer"),
        )
        if k in plots
    )
    trust = (
        "signatures verified against the trusted keys"
        if report.verified
        else "signatures NOT checked (no trusted key given): the figures are the store's say-so"
    )
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>engine_ext report: {e(report.store)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }} td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
th {{ background: #f3f3f3; }} img {{ max-width: 100%; }} .note {{ color: #555; }}
</style></head><body>
<h1>engine_ext report</h1>
<p class="note">Store <code>{e(report.store)}</code>: {len(report.rows)} version(s); {e(trust)}.
Written {time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())} by <code>engine-ext report</code>.</p>
<table id="versions"><tr><th>version</th><th>kind</th><th>changed</th><th>stored bytes</th><th>stored MiB</th>
<th>dense MiB</th><th>smaller</th><th>bytes per change</th><th>first-order bound per change</th>
<th>positions coders (parts)</th><th>signatures</th></tr>
{"".join(rows)}</table>
{imgs}
{"<h2>Replicas</h2><table id='replicas'><tr><th>server</th><th>version</th><th>versions behind</th><th>last update</th><th>error</th></tr>" + reps + "</table>" if report.replicas else ""}
</body></html>
"""
    path = out / "index.html"
    path.write_text(page)
    return path


__all__ = ["ReplicaRow", "Report", "VersionRow", "collect", "group_of", "manifest_keys", "render", "replicas"]
