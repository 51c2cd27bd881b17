"""The manifest of a published version (format version 12; spec in docs/FORMAT.md).

A manifest is small JSON naming the versions, fingerprints, blobs and, per tensor,
where its encoded positions and values lie; a delta also names the manifest(s) of its
base version by SHA-256, and a big tensor's changes may come in boxes (``chunks``,
format 3) that a rank fetches on its own (:mod:`engine_ext.format.chunks`). Parsing validates
everything a hostile manifest could abuse (sizes, counts, offsets, names, boxes) before
any blob is fetched. Signatures over the raw bytes are checked before parsing
(:mod:`engine_ext.store.signing`). Format 5 carries the context-conditioned coder (``ctx``,
:mod:`engine_ext.format.context.codec`): a changed tensor or cell coded given its base weights,
its steps under the version's shared ``step_tables``. Format 6 lets an anchor's tensor
come in cells too (a sharded trainer's ranks each write the rows they hold); writers
write the lowest version that describes a manifest (:meth:`Manifest.lowest_version`), so
that format-5 readers keep reading everything else. Format 7 keeps a manifest of very many
tensors (a 1T MoE's ~140,000) small: its tensor entries lie in *tensor tables* and each cut
tensor's cells in a *cell table*, byte ranges of a blob named with their SHA-256 and
count (:class:`TableRef`); every reader reads the tensor tables, a rank only the cell tables
of the tensors it fetches (:mod:`engine_ext.format.tables`). Format 8 lets a blob's SHA-256 be
a *pieces* digest (``digest: "pieces"``: over the digests of its segments, cut at the byte ranges
the manifest lists into it; :mod:`engine_ext.format.pieces`), so a publisher hashes an anchor's
bytes once, not once per blob and again per tensor. Format 9 adds the coder ``ctx-rans``: the
context model's symbols on the project's own rANS stage, block-major chunks a rank decodes alone
(:mod:`engine_ext.format.context.rans_stage`), all of a part's bytes in its positions segment. Format 10
keeps tensor tables as fixed binary records behind a name *index*: a rank reads the index and only the
tables that hold its tensors (:mod:`engine_ext.format.tables`). Versions 1 to 4 are still read, but
not format 4's context-coded parts (an opt-in coder whose blocks did not follow the
engines' shards).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ..errors import IntegrityError, ManifestError
from . import cells, chunks, entries
from . import context as codec_v2
from . import fingerprint as fpr
from .bulk import MadeWhenAsked
from .dtypes import dtype_by_name
from .json_text import dumps_indent1
from .pieces import PIECES, cuts

if TYPE_CHECKING:
    from .entries import Columns, Ranges

FORMAT = "engine-ext-delta"
FORMAT_VERSION = 12  # the newest version this code reads and writes
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)
CHUNKED_ANCHORS = 6  # the first version whose anchors may come in cells
TABLES = 7  # the first version whose tensor entries and cells may lie in tables in the blobs
PIECE_DIGESTS = 8  # the first version whose blobs may carry a pieces digest (``digest: "pieces"``)
RANS_STREAMS = 9  # the first version whose parts may be coded ``ctx-rans`` (codec v2 on rANS, block-major chunks)
INDEXED = 10  # the first version whose tensor tables are binary records with a name index (a rank reads only its own)
CATCH_UP = 11  # the first version with catch-up deltas: a shortcut over several versions (``stands_for``)
CELL_SECTIONS = 12  # the first version whose tensor tables keep cut tensors' chunks in sections by TP share

DELTA, ANCHOR = "delta", "anchor"
CONTEXT_CODERS = ("ctx", "ctx-rans")  # coded given the base: format 5's range-coded streams, format 9's rANS chunks
POSITION_CODERS = {"none", "all", "pco", "zstd", *CONTEXT_CODERS}
VALUE_CODERS = {"none", "raw", "pco", "zstd", *CONTEXT_CODERS}
MODES = {"abs", "rel"}

# Limits that bound the work a hostile manifest can cause.
MAX_MANIFEST_BYTES = 64 << 20
MAX_TENSORS = 1_000_000
MAX_NUMEL = 1 << 40
MAX_NDIM = 8
MAX_TENSOR_TABLES = 4096  # tensor tables per manifest
MAX_TENSOR_TABLES_BYTES = 1 << 30  # every reader reads them all (1M tensors at ~400 bytes each: 400 MB)
CELL_RECORD_BYTES = 75  # a chunk in a cell table (format 7: engine_ext.format.tables.CELL_RECORD)
SECTION_RECORD_BYTES = 77  # a chunk in a cell section: its tensor's row, then a cell record (format 12)
MAX_SHARES = 64  # shares a tensor table's cell sections are cut for (format 12)
INDEX_RECORD_BYTES = 12  # a tensor in the name index (format 10: engine_ext.format.tables.INDEX_RECORD)
MAX_ENTRY_BYTES = 64 << 10  # bytes per tensor entry in a tensor table (a name of 1024 characters, a grid of 256 cuts)
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_HEX_RE = re.compile(r"(?:[0-9a-f]{2})+")
_FP_RE = re.compile(r"[0-9a-f]{16}")
_KEY_RE = re.compile(r"[A-Za-z0-9._-]+")  # blob keys are plain names next to the manifest (fullmatch)


def manifest_key(version: int, kind: str = DELTA) -> str:
    return f"v{version:08d}.json" if kind == DELTA else f"v{version:08d}.anchor.json"


def catch_up_key(base_version: int, version: int) -> str:
    """Where the catch-up delta from ``base_version`` to ``version`` lies (format 11): a reader that
    holds the base finds it by name, with no listing of the store."""
    return f"v{version:08d}.from{base_version:08d}.json"


@dataclass
class Blob:
    key: str
    size: int
    sha256: str  # of its bytes; with ``digest`` "pieces" (format 8), over its segments' (engine_ext.format.pieces)
    digest: str | None = None


@dataclass
class TableRef:
    """Where a table lies (format 7): ``blob[offset : offset + length]``, the compact JSON array of
    ``count`` entries (tensor entries, or a tensor's chunks), checked against ``sha256`` before it
    is parsed."""

    blob: int
    offset: int
    length: int
    sha256: str
    count: int


class CellSections(NamedTuple):
    """Where a format-12 tensor's chunks lie: in its tensor table's cell sections (docs/FORMAT.md, "Cell
    sections"), each cell in the section of the share its first element falls in along dimension ``dim``
    (:func:`engine_ext.format.chunks.share_of`), among ``len(sections)`` shares. A rank of tensor parallelism
    reads the sections of its own share only, each checked against its SHA-256 in the table. A named tuple:
    a K2 TP rank makes 140 k of them per version (a frozen dataclass took three times as long)."""

    sections: tuple[TableRef, ...]  # share 1, 2, ...: the table's (a share with no record: count 0, not read)
    table: int  # the tensor table's place in the manifest
    row: int  # the tensor's record in that table
    dim: int  # 0 or 1
    records: int  # its records over every section (a cell table's ``count``)


@dataclass
class Segment:
    coder: str
    length: int
    mode: str | None = None  # values only


@dataclass
class Chunk:
    """The changes of one cell of a tensor's grid: positions are cell-local row-major indices;
    bytes, like a whole tensor's, are ``blob[offset : offset + positions + values]``."""

    cell: int  # row-major over the grid's cells
    nnz: int
    blob: int
    offset: int
    sha256: str
    positions: Segment
    values: Segment

    @property
    def length(self) -> int:
        return self.positions.length + self.values.length


class CellChunks(MadeWhenAsked):
    """A cut tensor's chunks as read from its cell table or cell sections: rows ``[start, stop)`` of a
    checked :data:`~engine_ext.format.cells.CELL_RECORD` array (in cell order), made :class:`Chunk` objects
    all together the first time one is asked for. A tensor-parallel rank of Kimi-K2 reads ~300 k chunks per
    version: as objects they were a fifth of its metadata time, yet its fetch plans from the records alone
    (:attr:`records`) and its decode asks for one tensor's chunks at a time."""

    __slots__ = ("_all", "_start", "_stop")

    def __init__(self, records: np.ndarray, start: int = 0, stop: int | None = None):
        super().__init__()
        self._all, self._start = records, start
        self._stop = len(records) if stop is None else stop

    @property
    def records(self) -> np.ndarray:
        return self._all[self._start : self._stop]

    @property
    def span(self) -> tuple[np.ndarray, int, int]:
        """(the records array these chunks lie in, their first row, the row after their last): a reader of
        many tensors' chunks takes each array's fields once, not a slice's per tensor."""
        return self._all, self._start, self._stop

    def make(self) -> list[Chunk]:
        return chunks_of_records(self.records)

    def __len__(self) -> int:
        return self._stop - self._start

    def __repr__(self) -> str:
        return f"<{len(self)} chunks as cell records>"


def chunks_of_records(rec: np.ndarray) -> list[Chunk]:
    """:data:`~engine_ext.format.cells.CELL_RECORD` records (checked) as :class:`Chunk` objects, a field at a time."""
    fields = ("cell", "nnz", "blob", "offset", "positions_length", "values_length")
    cols = [rec[f].tolist() for f in (*fields, "positions_coder", "values_coder", "mode", "sha256")]
    coders, modes = cells.CELL_CODERS, cells.CELL_MODES
    return [
        Chunk(c, n, b, o, h.hex(), Segment(coders[p], pl), Segment(coders[v], vl, modes[md]))
        for c, n, b, o, pl, vl, p, v, md, h in zip(*cols)
    ]


@dataclass
class TensorEntry:
    name: str
    dtype: str
    shape: list[int]
    nnz: int
    fingerprint: str
    base_fingerprint: str | None = None
    blob: int | None = None
    offset: int = 0  # positions bytes first, values right after
    sha256: str | None = None  # of the tensor's bytes [offset, offset + positions + values)
    positions: Segment = field(default_factory=lambda: Segment("none", 0))
    values: Segment = field(default_factory=lambda: Segment("none", 0))
    grid: list[list[int]] | None = None  # format 3: cut points along the first one or two dimensions
    # format 3: the changes per grid cell (then no tensor-level bytes); read from a table: CellChunks
    chunks: list[Chunk] | CellChunks | None = None
    # format 7: where ``chunks`` lie instead, a cell table; format 12: or its table's cell sections (None once read)
    cells: TableRef | CellSections | None = None

    def boxes(self) -> tuple:
        """The cells of ``grid`` as (start, stop) boxes, in cell order."""
        return chunks.boxes(self.grid, self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def length(self) -> int:
        return self.positions.length + self.values.length


REQUIRED_TENSOR_FIELDS = (
    "name",
    "dtype",
    "shape",
    "nnz",
    "fingerprint",
)  # the fields of a tensor entry without a default


@dataclass
class Manifest:
    kind: str
    model: str
    version: int
    fingerprint: str
    base_version: int | None = None
    base_fingerprint: str | None = None
    anchor_version: int | None = None  # newest anchor at or before this version
    base_manifests: list[str] = field(default_factory=list)  # deltas: SHA-256 of every manifest of the base version
    created_unix: float = 0.0
    blobs: list[Blob] = field(default_factory=list)
    tensors: list[TensorEntry] = field(default_factory=list)
    step_tables: dict[str, list[str]] | None = None  # format 5: per dtype, the context coder's step tables (hex)
    tables: list[TableRef] | None = None  # format 7: where the tensor entries lie (``tensors`` empty until resolved)
    index: TableRef | None = None  # format 10: the name index of the (binary) tensor tables
    # format 11, a catch-up delta: SHA-256 of the manifest of ``version`` whose weights it rebuilds from
    # ``base_version``'s in one step (the chain between them composed); a reader then holds that manifest
    stands_for: str | None = None
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    held = None  # type: frozenset[str] | None  # not a field: the names a rank read (format 10, tables.select); ``tensors`` is then a subset

    @property
    def key(self) -> str:
        """Where it is published: its version's key (:func:`manifest_key`), or a catch-up's own (:func:`catch_up_key`)."""
        if self.stands_for is not None:
            return catch_up_key(self.base_version, self.version)
        return manifest_key(self.version, self.kind)

    @property
    def entries(self) -> int:
        """Tensor entries and chunks listed inline: what a manifest's size grows with (~400 and ~350 bytes each)."""
        return len(self.tensors) + sum(len(t.chunks or ()) for t in self.tensors)

    def lowest_version(self) -> int:
        """The lowest format version that describes this manifest, which writers write (a
        format-5 reader then still reads everything but a chunked anchor): 12 with cell sections (a writer of tables
        says so itself: :func:`engine_ext.format.tables.tabulate`), 10 with a name index, 9 with a
        ``ctx-rans`` part (as listed inline), 8 with a pieces digest, 7 with tables, 6 for an anchor with a
        chunked tensor, else 5; 11 for a catch-up delta."""
        if self.stands_for is not None:
            return CATCH_UP
        if self.index is not None:
            return INDEXED
        if any(p.positions.coder == "ctx-rans" for t in self.tensors for p in [t, *(t.chunks or ())]):
            return RANS_STREAMS
        if any(b.digest == PIECES for b in self.blobs):
            return PIECE_DIGESTS
        if self.tables is not None or any(t.cells is not None for t in self.tensors):
            return TABLES
        return CHUNKED_ANCHORS if self.kind == ANCHOR and any(t.chunks for t in self.tensors) else 5

    @property
    def resolved(self) -> bool:
        """Whether ``tensors`` holds every tensor entry (format 7: once its tensor tables are read)."""
        return self.tables is None or bool(self.tensors) or self.held is not None  # a table holds an entry or more

    def require_resolved(self) -> None:
        if not self.resolved:
            raise ManifestError(
                "a format-7 manifest whose tensor tables were not read "
                "(read it with engine_ext.store.reader.read_link / open_manifest)"
            )

    def require_whole(self) -> None:
        """Refuse a manifest of which a rank read only its own tensors (a check over every tensor needs all)."""
        self.require_resolved()
        if self.held is not None:
            raise ManifestError("this manifest was read for a rank's own tensors only; this needs every tensor")

    def tables_for(self, dtype: str) -> list[bytes]:
        """The step tables context-coded parts of ``dtype`` are decoded with."""
        return [bytes.fromhex(h) for h in (self.step_tables or {}).get(dtype, [])]

    @property
    def payload_bytes(self) -> int:
        return sum(b.size for b in self.blobs)

    def segment_bounds(self, blob: int) -> list[int]:
        """Where blob ``blob``'s segments begin and end (:func:`engine_ext.format.pieces.cuts`): at every
        byte range listed into it (tensor entries, chunks, tables). Every cell table must be read
        first: its chunks' ranges are segment boundaries too."""
        self.require_whole()
        if any(t.cells is not None for t in self.tensors):
            raise ManifestError("a pieces digest's segments need every cell table read first (load_cells)")
        ranges = [(r.offset, r.length) for r in self.tables or () if r.blob == blob]
        return cuts(self.blobs[blob].size, ranges + listed_ranges(self.tensors, blob))

    def to_json(self) -> bytes:
        """The manifest's bytes; fields of formats 7, 8 and 11 only where set (older readers refuse keys they do
        not know)."""
        return dumps_indent1(
            self, {Manifest: ("tables", "index", "stands_for"), TensorEntry: ("cells",), Blob: ("digest",)}
        )  # json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse and validate a manifest. A format-7 manifest with tensor tables comes back unresolved
        (``tensors`` empty, its header validated): :meth:`resolve` takes its tables."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest is {len(data)} bytes, over the {MAX_MANIFEST_BYTES} limit")
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested too deep
            raise ManifestError(f"manifest is not valid JSON: {str(e)[:200]}") from None
        m = parse_checked(lambda: _parse(d))
        parse_checked(m.validate)
        return m

    def check_coders(self, where: str, p: Segment, v: Segment, dtype: str) -> None:
        """The rules on a part's coders and value mode alone, the same for every part that shares them
        (a cell table's records are checked once per distinct triple: engine_ext.format.cell_reads.read_cells)."""

        def bad(msg):
            raise ManifestError(_cut(msg))

        if p.coder not in POSITION_CODERS or v.coder not in VALUE_CODERS:
            bad(f"{where}: unknown coder {p.coder!r}/{v.coder!r}")
        if v.mode not in MODES:
            bad(f"{where}: unknown value mode {v.mode!r}")
        if self.kind == ANCHOR and (v.mode != "abs" or p.coder != "all"):
            bad(f"{where}: anchors hold every element as absolute bits")
        if p.coder == "none" or v.coder == "none":
            bad(f"{where}: changed elements need positions and values")
        if (p.coder in CONTEXT_CODERS or v.coder in CONTEXT_CODERS) and p.coder != v.coder:
            bad(f"{where}: context-coded positions and values come together, under one coder")
        if p.coder in CONTEXT_CODERS:
            if self.format_version < 5 or self.kind != DELTA or v.mode != "rel" or not codec_v2.supports(dtype):
                bad(f"{where}: the context coder needs a format-5 delta of relative steps of a float dtype it supports")
            if p.coder == "ctx-rans" and self.format_version < RANS_STREAMS:
                bad(f"{where}: 'ctx-rans' needs format {RANS_STREAMS}, its bytes all in the positions segment")
            if not (self.step_tables or {}).get(dtype):
                bad(f"{where}: context-coded, but the manifest has no step tables for {dtype}")

    def _check_step_tables(self) -> None:
        t = self.step_tables
        if self.format_version < 5 or self.kind != DELTA or not isinstance(t, dict) or len(t) > 8:
            raise ManifestError("step_tables: only a format-5 delta carries them, as a dict per dtype")
        for dtype, tables in t.items():
            if (
                not isinstance(dtype, str)
                or not codec_v2.supports(dtype)
                or not isinstance(tables, list)
                or not 1 <= len(tables) <= codec_v2.MAX_STEP_TABLES
            ):
                raise ManifestError(f"step_tables: bad entry for {str(dtype)[:40]!r}")
            for h in tables:
                if (
                    not isinstance(h, str)
                    or len(h) != 2 * codec_v2.alphabet(dtype)
                    or not _HEX_RE.fullmatch(h)
                    or 0 in bytes.fromhex(h)
                ):
                    raise ManifestError(
                        f"step_tables: a {dtype} table is not {codec_v2.alphabet(dtype)} nonzero hex bytes"
                    )

    def _check_ref(self, ref, where: str, per_entry: int, per_blob: list) -> None:
        """A table's place (format 7): a blob's byte range, a SHA-256, a count, bounded per entry."""
        if not isinstance(ref, TableRef) or not all(_is_int(x) for x in (ref.blob, ref.offset, ref.length, ref.count)):
            raise ManifestError(f"{where}: a bad table reference")
        if self.format_version < TABLES:
            raise ManifestError(f"{where}: only format-7 manifests keep tables in their blobs")
        if not 0 <= ref.blob < len(self.blobs) or ref.offset < 0 or ref.offset + ref.length > self.blobs[ref.blob].size:
            raise ManifestError(f"{where}: table beyond its blob")
        if self.blobs[ref.blob].digest is not None:  # its segments would change as its cell tables are read
            raise ManifestError(f"{where}: a blob holding tables has a flat SHA-256")
        if not 1 <= ref.count or not 2 <= ref.length <= ref.count * per_entry:
            raise ManifestError(f"{where}: {ref.length} bytes for {ref.count} entries")
        if not isinstance(ref.sha256, str) or not _SHA_RE.fullmatch(ref.sha256):
            raise ManifestError(f"{where}: missing or bad sha256")
        per_blob[ref.blob].append((ref.offset, ref.offset + ref.length, where))

    def _section_ranges(self, places: np.ndarray) -> Ranges:
        """The cell sections of the tables read (format 12; :data:`~engine_ext.format.tensor_records.SECTION_PLACE`
        records, each with records): each a byte range of a blob with a flat SHA-256, of SECTION_RECORD_BYTES a
        record; their ranges, for the overlap check."""
        where = lambda i: f"tensor table {int(places['table'][i])}: cell section {int(places['share'][i])}"
        sizes = np.array([min(b.size, cells.MAX_OFFSET) for b in self.blobs] or [0], np.int64)
        flat = np.array([b.digest is None for b in self.blobs] or [True], bool)
        blob, offset = places["blob"], places["offset"]
        end = offset + places["count"] * SECTION_RECORD_BYTES  # each far below 2**62: no wrap
        known = np.minimum(blob, len(sizes) - 1)
        bad = (blob >= len(self.blobs)) | (end > sizes[known]) | ~flat[known]
        if bad.any():
            raise ManifestError(_cut(f"{where(int(np.argmax(bad)))}: beyond its blob, or in a blob of a pieces digest"))
        return entries.Ranges(blob, offset, end, where)

    def _check_inline_chunks(self, cut: list[TensorEntry]) -> tuple[np.ndarray, Callable[[int], str]]:
        """The chunks of every cut tensor listed inline (``cut``, each entry checked): as cell records, by
        the rules a cell table's records meet (:mod:`engine_ext.format.cells`: one numpy pass per rule over
        all of them; a Kimi-K2 commit checks over a million). Returns the records and how an error names
        record i, for the overlap check across the whole manifest."""
        everyone = [c for t in cut for c in t.chunks]
        counts = np.array([len(t.chunks) for t in cut], np.int64)
        owner = np.repeat(np.arange(len(cut)), counts)

        def where(i: int) -> str:
            return _cut(f"tensor {cut[owner[i]].name!r} cell {everyone[i].cell!r}", 200)

        rec = cells.records(everyone, where)
        cells.check(self, cells.Owners.of_entries(cut), counts, rec, where)
        return rec, where

    def validate(self, name_keys: np.ndarray | None = None, columns: Columns | None = None) -> np.ndarray | None:
        """Raise ManifestError unless every field is consistent and within limits (format 7 before its
        tables are read: every field but the tensors'). Returns the cell records of the chunks listed
        inline, as checked (:func:`engine_ext.format.tables.tabulate` writes them: a commit makes them once).
        ``name_keys``: the tensors' name keys, in order, where the caller made them (a commit, for its
        fingerprints: 140 k SHA-256s at K2 size); else made here. ``columns``: the tensors' columns, where the
        caller made them (a rank writing its tables uses them again); else :meth:`columns`."""

        def bad(msg):
            raise ManifestError(_cut(msg))

        _check_format(self.format, self.format_version)
        if (
            not isinstance(self.base_manifests, list)
            or len(self.base_manifests) > 4
            or not all(isinstance(h, str) and _SHA_RE.fullmatch(h) for h in self.base_manifests)
        ):
            bad(f"bad base_manifests {self.base_manifests!r:.100}")
        if self.base_manifests and (self.kind != DELTA or self.format_version < 2):
            bad("only format-2 deltas name base manifests")
        if self.kind not in (DELTA, ANCHOR):
            bad(f"unknown kind {self.kind!r}")
        if self.stands_for is not None and (
            self.kind != DELTA
            or self.format_version < CATCH_UP
            or not isinstance(self.stands_for, str)
            or not _SHA_RE.fullmatch(self.stands_for)
        ):
            bad(f"stands_for {self.stands_for!r:.100}: only a format-{CATCH_UP} delta names the manifest it stands for")
        if self.step_tables is not None:
            self._check_step_tables()
        if not _is_int(self.version) or self.version < 0:
            bad(f"bad version {self.version!r}")
        if self.anchor_version is not None and not (
            _is_int(self.anchor_version) and 0 <= self.anchor_version <= self.version
        ):
            bad(f"anchor_version {self.anchor_version!r} is not a version at or before {self.version}")
        if (
            not isinstance(self.model, str)
            or isinstance(self.created_unix, bool)
            or not isinstance(self.created_unix, (int, float))
        ):
            bad("model must be a string and created_unix a number")
        if self.kind == DELTA and (not _is_int(self.base_version) or not 0 <= self.base_version < self.version):
            bad(f"a delta needs a base_version below its version, got {self.base_version!r} -> {self.version}")
        fpr.parse(self.fingerprint)
        if self.kind == DELTA or self.base_fingerprint is not None:  # an anchor's is null or a fingerprint
            fpr.parse(self.base_fingerprint)
        if len(self.tensors) > MAX_TENSORS:
            bad(f"{len(self.tensors)} tensors, over the {MAX_TENSORS} limit")
        for b in self.blobs:
            if not isinstance(b.key, str) or not _KEY_RE.fullmatch(b.key) or b.key.startswith("."):
                bad(f"bad blob key {b.key!r:.100}")
            if (
                not _is_int(b.size)
                or not 0 <= b.size <= cells.MAX_OFFSET
                or not isinstance(b.sha256, str)
                or not _SHA_RE.fullmatch(b.sha256)
            ):
                bad(f"bad blob entry {b.key!r}")
            if b.digest is not None and (b.digest != PIECES or self.format_version < PIECE_DIGESTS):
                bad(f"blob {b.key!r}: digest {b.digest!r:.40} (only {PIECES!r}, from format {PIECE_DIGESTS})")
        per_blob = [[] for _ in self.blobs]
        if self.tables is not None:
            if not isinstance(self.tables, list) or not 1 <= len(self.tables) <= MAX_TENSOR_TABLES:
                bad(f"tables: a list of 1 to {MAX_TENSOR_TABLES} tensor tables")
            for i, ref in enumerate(self.tables):
                self._check_ref(ref, f"tensor table {i}", MAX_ENTRY_BYTES, per_blob)
            if sum(r.count for r in self.tables) > MAX_TENSORS:
                bad(f"the tensor tables hold over {MAX_TENSORS} tensors")
            if sum(r.length for r in self.tables) > MAX_TENSOR_TABLES_BYTES:
                bad(f"the tensor tables take over {MAX_TENSOR_TABLES_BYTES} bytes")
            if self.index is not None:
                if self.format_version < INDEXED:
                    bad(f"only format-{INDEXED} manifests have a name index")
                self._check_ref(self.index, "the name index", INDEX_RECORD_BYTES, per_blob)
                if (
                    self.index.count != sum(r.count for r in self.tables)
                    or self.index.length != self.index.count * INDEX_RECORD_BYTES
                ):
                    bad(
                        f"the name index holds {self.index.count} records in {self.index.length} bytes "
                        f"for {sum(r.count for r in self.tables)} tensors"
                    )
            elif self.format_version >= INDEXED:
                bad(f"a format-{INDEXED} manifest with tensor tables needs a name index")
            if not self.resolved:
                _no_overlap(per_blob)
                return None
            if self.held is None and sum(r.count for r in self.tables) != len(self.tensors):
                bad(f"the tensor tables hold {sum(r.count for r in self.tables)} tensors, {len(self.tensors)} read")
        elif self.index is not None:
            bad("only a manifest with tensor tables has a name index")
        columns = self.columns() if columns is None else columns
        inline, ranges = entries.check(self, columns)
        sections = getattr(self.tensors, "sections", None)  # format 12: the cell sections of the tables read
        if sections is not None and len(sections):
            ranges = entries.joined(ranges, self._section_ranges(sections))
        records, where = self._check_inline_chunks([self.tensors[i] for i in inline.tolist()])
        _no_overlap(per_blob, ranges, records, where)
        if self.held is not None:  # a rank's own tensors: the model's fingerprints need every one (the driver's read)
            return records
        keys = fpr.name_keys(columns.names) if name_keys is None else name_keys
        fp, base = columns.model_fingerprints(keys, self.kind == DELTA)
        if fpr.fmt(fp) != self.fingerprint:
            bad("model fingerprint does not match the tensors' fingerprints")
        if base is not None and fpr.fmt(base) != self.base_fingerprint:
            bad("base model fingerprint does not match the tensors' base fingerprints")
        return records

    def columns(self) -> Columns:
        """The tensor entries as columns: a binary table's as read (no entry object made), else made from the
        entries (each field refused unless the type its column needs)."""
        if isinstance(self.tensors, entries.ColumnEntries):
            return self.tensors.columns
        return entries.Columns.of_entries(self.tensors)


def listed_ranges(tensors: list[TensorEntry], blob: int) -> list[tuple[int, int]]:
    """(offset, length) of every part ``tensors`` list in blob ``blob``: whole tensors' and cells'
    (a pieces digest's segments end at each: :meth:`Manifest.segment_bounds`)."""
    ranges = []
    for t in tensors:
        if t.blob == blob and t.nnz:
            ranges.append((t.offset, t.length))
        ranges += [(c.offset, c.length) for c in t.chunks or () if c.blob == blob]
    return ranges


def _check_format(format, version) -> None:
    if format != FORMAT or not _is_int(version) or version not in READABLE_VERSIONS:
        raise ManifestError(
            _cut(f"unknown format {format!r} version {version!r} (this reader: {FORMAT} {READABLE_VERSIONS})")
        )


def _no_overlap(
    per_blob: list, entries: entries.Ranges | None = None, chunks: np.ndarray | None = None, chunk_where=None
) -> None:
    """Refuse byte ranges that overlap, all in one sort: ``per_blob``'s ((start, end, what) per blob: the
    tensor tables and name index), the tensor ``entries``' (their own bytes, their cell tables) and the
    ``chunks``' (cell records; ``chunk_where(i)`` names record i)."""
    listed = [(b, s, e) for b, ranges in enumerate(per_blob) for s, e, _ in ranges]
    whats = [w for ranges in per_blob for _, _, w in ranges]
    if chunks is None:
        chunks = np.zeros(0, cells.CELL_RECORD)
    none = np.zeros(0, np.int64)
    own = (none, none, none) if entries is None else (entries.blob, entries.start, entries.end)
    ends = chunks["offset"].astype(np.int64) + chunks["positions_length"] + chunks["values_length"]
    first = (np.array([x[i] for x in listed], np.int64) for i in range(3))
    blob, start, end = (
        np.concatenate([a, o.astype(np.int64), c.astype(np.int64)])
        for a, o, c in zip(first, own, (chunks["blob"], chunks["offset"], ends))
    )
    pair = cells.first_overlap(blob, start, end)
    if pair is not None:
        n, k = len(whats), len(own[0])

        def what(i: int) -> str:
            if i < n:
                return whats[i]
            return entries.where(i - n) if i < n + k else chunk_where(i - n - k)

        raise ManifestError(_cut(f"{what(pair[0])} and {what(pair[1])} overlap in their blob"))


def dtype_by_name_checked(name, where):
    try:
        return dtype_by_name(name)
    except (ValueError, TypeError):
        raise ManifestError(_cut(f"{where}: unsupported dtype {name!r}")) from None


def _cut(msg: str, n: int = 500) -> str:
    """An error message cut short: a hostile manifest's values are never echoed at length."""
    return msg if len(msg) <= n else msg[:n] + "..."


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse(d: dict) -> Manifest:
    if not isinstance(d, dict):
        raise ManifestError("manifest must be a JSON object")
    if "format" not in d or "format_version" not in d:  # not assumed to be this reader's own
        raise ManifestError("manifest names no format and format_version")
    _check_format(d["format"], d["format_version"])  # before its fields: a newer format's are unknown here
    tensors = [tensor_from_json(t) for t in d["tensors"]]
    blobs = [Blob(**b) for b in d.get("blobs", [])]
    if any("digest" in b and b["digest"] is None for b in d.get("blobs", [])):
        raise ManifestError('a blob\'s digest is "pieces" or absent, never null')
    tables = d.get("tables")
    if tables is not None:
        if not isinstance(tables, list) or len(tables) > MAX_TENSOR_TABLES:
            raise ManifestError(f"tables: not a list of at most {MAX_TENSOR_TABLES}")
        tables = [TableRef(**_object(r)) for r in tables]
        if tensors:
            raise ManifestError("a manifest with tensor tables lists no tensors inline")
    index = d.get("index")
    index = None if index is None else TableRef(**_object(index))
    rest = {k: v for k, v in d.items() if k not in ("tensors", "blobs", "tables", "index")}
    return Manifest(blobs=blobs, tensors=tensors, tables=tables, index=index, **rest)


def parse_checked(parse):
    """``parse()``, whose malformed input (a missing or unknown field, a wrong type) is a ManifestError."""
    try:
        return parse()
    except (ManifestError, IntegrityError):
        raise
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
        raise ManifestError(f"malformed manifest: {type(e).__name__}: {str(e)[:200]}") from None


def _object(x) -> dict:
    if not isinstance(x, dict):  # dict() would also take a list of [key, value] pairs
        raise ManifestError("each tensor, chunk and table must be a JSON object")
    return x


def _chunk(c) -> Chunk:
    c = _object(c)
    return Chunk(**dict(c, positions=Segment(**c["positions"]), values=Segment(**c["values"])))


def tensor_from_json(t) -> TensorEntry:
    t = dict(_object(t))
    t["positions"] = Segment(**t.get("positions", {"coder": "none", "length": 0}))
    t["values"] = Segment(**t.get("values", {"coder": "none", "length": 0}))
    if t.get("chunks") is not None:
        if not isinstance(t["chunks"], list) or len(t["chunks"]) > 256 * 256:
            raise ManifestError(f"tensor {str(t.get('name'))[:100]!r}: bad chunk list")
        t["chunks"] = [_chunk(c) for c in t["chunks"]]
    if t.get("cells") is not None:
        t["cells"] = TableRef(**_object(t["cells"]))
    return TensorEntry(**t)
