"""``engine-ext report``: one self-contained HTML page from a store's signed manifests (the golden store of
tests/test_golden.py: an anchor, a delta of few changes, a context-coded delta).

* Content (CI): every figure on the page matches the manifests (kind, share changed, stored and dense
  bytes, the positions coders), the first-order bound is there for each delta, the three plots are
  inlined, nothing is fetched from elsewhere; a replica's version, lag and last update come from its
  status route; a manifest whose signature does not verify stops the report.
* Browser (``full``): headless Chromium from Debian's packages loads the page with no console error, and
  its screenshot is not blank.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "golden"))
import make_golden  # noqa: E402

from engine_ext.cli import main  # noqa: E402
from engine_ext.format.dtypes import dtype_by_name  # noqa: E402
from engine_ext.store import open_store  # noqa: E402
from engine_ext.store.reader import load_cells, read_link  # noqa: E402
from engine_ext.store.signing import Trust  # noqa: E402

PUB = str(make_golden.KEY) + ".pub"


def rows_of(page: str) -> list[list[str]]:
    return [[re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]
            for row in re.findall(r"<tr data-version.*?</tr>", page)]


class StatusServer:
    """A replica's ``GET /update_weights_delta`` answering a fixed status (a stand-in: the report only reads it)."""

    def __init__(self, status: dict):
        body = json.dumps(status).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/update_weights_delta" else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture()
def report(tmp_path):
    store = shutil.copytree(make_golden.STORE, tmp_path / "store")
    seen = time.time() - 90
    replica = StatusServer({"version": 1, "history": [{"ok": True, "version": 1, "time": seen}]})
    try:
        code = main(["report", str(store), "--out", str(tmp_path / "out"), "--trust", PUB, "--servers", replica.url])
    finally:
        replica.close()
    assert code == 0
    return store, (tmp_path / "out" / "index.html").read_text(), replica.url, seen


def test_the_page_shows_what_the_manifests_say(report):
    store_dir, page, url, seen = report
    store = open_store(str(store_dir))
    rows = rows_of(page)
    assert [r[0] for r in rows] == ["0", "1", "2"]
    for r, key in zip(rows, ["v00000000.anchor.json", "v00000001.json", "v00000002.json"]):
        m = read_link(store, key, Trust.from_public_keys([PUB])).manifest
        load_cells(store, m)
        numel = sum(math.prod(t.shape) for t in m.tensors)
        nnz = sum(t.nnz for t in m.tensors)
        dense = sum(math.prod(t.shape) * dtype_by_name(t.dtype).itemsize for t in m.tensors)
        coders = sorted({p.positions.coder for t in m.tensors for p in (t.chunks or [t]) if p.positions.coder != "none"})
        assert r[1] == m.kind and r[2] == f"{nnz / numel * 100:.3f} %" and int(r[3]) == m.payload_bytes, (key, r)
        assert r[5] == f"{dense / 2**20:,.3f}" and sorted(c.split()[0] for c in r[9].split(", ")) == coders, (key, r)
        if m.kind == "delta":
            assert float(r[7]) == pytest.approx(m.payload_bytes / nnz, abs=1e-3) and float(r[8]) > 0, r
        assert r[10] == "1"  # one valid signature
    assert "ctx-rans" in rows[2][9]
    assert len(re.findall(r"src='data:image/png;base64,", page)) == 3
    assert not re.search(r"(src|href)=['\"]?(https?:|//)", page)  # self-contained
    assert "signatures verified" in page
    rep = re.search(r"<table id='replicas'>.*?</table>", page).group(0)
    cells = [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td>(.*?)</td>", rep)]
    assert cells[:4] == [url, "1", "1", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seen))], cells


def test_a_manifest_that_does_not_verify_stops_the_report(tmp_path, capsys):
    store = shutil.copytree(make_golden.STORE, tmp_path / "store")
    doc = json.loads((store / "v00000001.json").read_text())
    doc["model"] = "tampered"
    (store / "v00000001.json").write_text(json.dumps(doc))
    assert main(["report", str(store), "--out", str(tmp_path / "out"), "--trust", PUB]) == 1
    assert "signature" in capsys.readouterr().err and not (tmp_path / "out" / "index.html").exists()


@pytest.mark.full
def test_the_page_renders_in_a_real_browser(report, tmp_path):
    """Headless Chromium (Debian's package): the page loads without a console error and is not blank."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium (apt-get install chromium)")
    _, page, _, _ = report
    html = tmp_path / "page.html"
    html.write_text(page)
    shot = tmp_path / "shot.png"
    r = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
                        "--window-size=1200,2000", f"--screenshot={shot}", html.as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert shot.exists(), r.stderr[-2000:]
    console = [ln for ln in r.stderr.splitlines() if "CONSOLE" in ln and ("Error" in ln or "error" in ln)]
    assert not console, console
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)
    assert pixels.std() > 0.05 and (pixels[..., :3] < 0.5).mean() > 0.01  # text and plots, not a blank page
