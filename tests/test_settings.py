"""The one settings object: every variable parsed once, bad values named, the docs table in sync."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine_ext import settings
from engine_ext.settings import VARIABLES, Settings

ROOT = Path(__file__).resolve().parents[1]


def test_from_env_parses_every_variable():
    s = Settings.from_env({"ENGINE_EXT_SOURCES": " /a , s3://b/c ,", "ENGINE_EXT_TOKEN": "t", "ENGINE_EXT_BASE_VERSION": "7",
                           "ENGINE_EXT_MAX_DECODED_BYTES": "1024",
                           "ENGINE_EXT_HTTP_TOKEN": "h", "ENGINE_EXT_S3_ENDPOINT": "http://127.0.0.1:9000",
                           "UNRELATED": "x"})
    assert s == Settings(sources=("/a", "s3://b/c"), token="t", base_version=7,
                         max_decoded_bytes=1024, http_token="h", s3_endpoint="http://127.0.0.1:9000")
    s = Settings.from_env({"ENGINE_EXT_NO_AUTH": "yes", "ENGINE_EXT_ALLOW_UNSIGNED": "0", "ENGINE_EXT_TRUSTED_KEYS": "a.pub,b.pub",
                           "ENGINE_EXT_SIGNATURE_THRESHOLD": "2", "ENGINE_EXT_FETCH_TIMEOUT": "2.5", "ENGINE_EXT_MAX_WAITING": "1"})
    assert (s.no_auth, s.allow_unsigned, s.trusted_keys, s.signature_threshold, s.fetch_timeout, s.max_waiting) == (
        True, False, ("a.pub", "b.pub"), 2, 2.5, 1)
    assert Settings.from_env({}) == Settings() and Settings.from_env({"ENGINE_EXT_TOKEN": ""}).token is None


@pytest.mark.parametrize("name,value", [("ENGINE_EXT_BASE_VERSION", "v3"), ("ENGINE_EXT_MAX_DECODED_BYTES", "1e9"),
                                        ("ENGINE_EXT_NO_AUTH", "maybe"), ("ENGINE_EXT_FETCH_TIMEOUT", "-1")])
def test_bad_value_names_the_variable(name, value):
    with pytest.raises(ValueError, match=name):
        Settings.from_env({name: value})


def test_read_once_and_override(monkeypatch):
    monkeypatch.setattr(settings, "_current", None)  # restored after the test: the run's settings stay
    monkeypatch.setenv("ENGINE_EXT_TOKEN", "first")
    assert settings.current().token == "first"
    monkeypatch.setenv("ENGINE_EXT_TOKEN", "second")
    assert settings.current().token == "first"  # read once, when the plugin loaded
    with settings.override(token="o") as s:
        assert settings.current() is s and s.token == "o"
    assert settings.current().token == "first"


def test_docs_table_is_the_variables():
    doc = (ROOT / "docs" / "settings.md").read_text()
    assert settings.markdown_table() in doc
    assert {v.name for v in VARIABLES} == set(re.findall(r"`(ENGINE_EXT_[A-Z0-9_]+)`", doc))


def test_no_module_reads_engine_ext_variables_itself():
    """Every ENGINE_EXT_* variable is read in engine_ext/settings.py only."""
    read = re.compile(r"""(environ(\.get)?\s*[\[(]|getenv\()\s*["']ENGINE_EXT_""")
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "engine_ext").rglob("*.py")
                 if p.name != "settings.py" and read.search(p.read_text())]
    assert offenders == []
    assert read.search('os.environ.get("ENGINE_EXT_TOKEN")') and read.search("os.environ['ENGINE_EXT_X']")
