"""Shared fixtures. Server fixtures start real loopback servers once per module
(helpers in tests/servers.py)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `import servers` from any test module


def _test_this_checkout():
    """The suite tests the checkout it sits in, also from a git worktree of a repo whose venv has an
    editable install of another checkout: this root goes first on ``sys.path`` and on the ``PYTHONPATH``
    every server the tests start inherits (their plugin entry point imports ``engine_ext`` by name)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH")] if p)


_test_this_checkout()

import server_report  # noqa: E402
from servers import serve_http, serve_s3  # noqa: E402

TEST_TOKEN = "engine-ext-test-token"


def _secure_by_default_for_the_whole_run():
    """The suite runs the product as deployed: every version signed, every route behind a token.

    One Ed25519 key for the run: ``ENGINE_EXT_SIGNING_KEY`` makes every publisher and CLI
    call sign, ``ENGINE_EXT_TRUSTED_KEYS`` makes every server (in-process or a subprocess,
    which inherits the environment) verify, ``ENGINE_EXT_TOKEN`` guards every route. Set
    before anything reads the settings. Tests of unsigned or open set-ups say so explicitly.
    """
    import tempfile

    from engine_ext.store.signing import generate_key

    d = tempfile.mkdtemp(prefix="engine_ext_test_keys_")
    generate_key(os.path.join(d, "publisher.key"))
    os.environ["ENGINE_EXT_SIGNING_KEY"] = os.path.join(d, "publisher.key")
    os.environ["ENGINE_EXT_TRUSTED_KEYS"] = os.path.join(d, "publisher.key.pub")
    os.environ["ENGINE_EXT_TOKEN"] = TEST_TOKEN
    for name in ("ENGINE_EXT_ALLOW_UNSIGNED", "ENGINE_EXT_NO_AUTH"):
        os.environ.pop(name, None)
    # Publishers code bytes first (codec v2 wherever it saves 10 %), so every engine test decodes codec v2;
    # the deployed default (GPU readers at 100 MB/s: v1 where v2 does not pay) is tested in test_context_codec.py.
    os.environ["ENGINE_EXT_READER_MBPS"] = "0"


_secure_by_default_for_the_whole_run()


def _hooks_on_every_path() -> None:
    """tests/server_hooks first on ``PYTHONPATH`` (once), so every process the run starts loads them."""
    hooks = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server_hooks")
    if hooks not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [hooks, os.environ.get("PYTHONPATH")] if p)


def _hide_amx_for_the_whole_run():
    """``ENGINE_EXT_TEST_HIDE_AMX=1`` in the run's environment: the whole suite runs as on an AVX-512 host
    without AMX (vLLM 0.32 CPU's oneDNN GEMM, ``vec`` attention, CPUMLAImpl, the MoE prepack's ISA), in this
    process (its in-process vLLM ops) and in every process it starts (tests/server_hooks on their path)."""
    if os.environ.get("ENGINE_EXT_TEST_HIDE_AMX") != "1":
        return
    _hooks_on_every_path()
    import torch.cpu

    torch.cpu._is_amx_tile_supported = lambda: False


_hide_amx_for_the_whole_run()


def _quiet_vllm_queues_for_the_whole_run():
    """Every vLLM server the suite starts (its own, the chaos soak's, verl's replicas under Ray) gets
    ``ENGINE_EXT_TEST_QUIET_SPIN=1`` (tests/server_hooks): vLLM's shared-memory queue readers sleep
    0.5 ms between looks while busy instead of spinning on ``sched_yield()``: on a 2-core CI host the
    spinning readers take the cores from the processes they wait for (``python bench/queue_spin.py``;
    figures in docs/vllm.md). What the servers compute is unchanged. ``ENGINE_EXT_TEST_QUIET_SPIN=0``
    runs vLLM's own spin."""
    if os.environ.get("ENGINE_EXT_TEST_QUIET_SPIN") == "0":
        return
    os.environ["ENGINE_EXT_TEST_QUIET_SPIN"] = "1"
    _hooks_on_every_path()


_quiet_vllm_queues_for_the_whole_run()


def _stacks_on_request_for_the_whole_run():
    """Every process the suite starts writes its threads' Python stacks to its stderr on SIGUSR2
    (``ENGINE_EXT_TEST_STACKS=1``, tests/server_hooks): a server start that hangs is sent it before it
    is stopped, so its log names where each of its processes waited (tests/vllm_helpers.py)."""
    os.environ["ENGINE_EXT_TEST_STACKS"] = "1"
    _hooks_on_every_path()


_stacks_on_request_for_the_whole_run()


def _import_kernels_for_the_interpreter():
    """Decorate our Triton kernels in interpreter mode before any test module imports vLLM.

    Importing vLLM (collection of the vLLM tests) changes Triton's state so that kernels
    decorated afterwards fail under TRITON_INTERPRET=1 ("Cannot call @triton.jit'd
    outside of the scope of a kernel"). The variable is restored at once; the kernel
    tests set it again while they run.
    """
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import engine_ext.triton_kernels.apply_kernel  # noqa: F401
        import engine_ext.triton_kernels.context_scan  # noqa: F401
        import engine_ext.triton_kernels.rans_decode  # noqa: F401
    except ImportError:
        pass
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


_import_kernels_for_the_interpreter()

from fake_ranks import publish_run  # noqa: E402 - engine_ext only once the run's settings and kernels are set up


def _interpreted(module: str, kernel: str):
    """Import ``module`` with TRITON_INTERPRET set (reloading it if ``kernel`` was decorated without
    it), yield it, then restore TRITON_INTERPRET.

    TRITON_INTERPRET must be set when the kernel is decorated and while it runs
    (Triton imports parts lazily), and unset afterwards so other tests (vLLM servers)
    do not inherit it.
    """
    import importlib

    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    mod = importlib.import_module(module)
    if "Interpreted" not in type(getattr(mod, kernel)).__name__:
        mod = importlib.reload(mod)
    yield mod
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


@pytest.fixture(scope="module")
def interp():
    """The kernel module, run by Triton's interpreter on CPU tensors, for one test module."""
    yield from _interpreted("engine_ext.triton_kernels.apply_kernel", "_apply_kernel")


@pytest.fixture(scope="module")
def ctx_interp():
    """The context pass's kernel module (``engine_ext.triton_kernels.context_scan``) run by Triton's
    interpreter on CPU tensors, for one test module (as :func:`interp` does for the apply kernel)."""
    yield from _interpreted("engine_ext.triton_kernels.context_scan", "_block_find_kernel")


@pytest.fixture
def published_run(tmp_path):
    """``(store, versions)``: a small run published to a fresh local store (:func:`fake_ranks.publish_run`:
    v0 and three steps) and the state of each version, for tests that drive in-process ranks through it."""
    return tmp_path / "store", publish_run(tmp_path / "store")


@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    """Static HTTP server (Range, optional PUT/auth/failures) over a fresh temp dir.
    Module-scoped: call ``http_server.reset()`` to clear switches set by an earlier test."""
    with serve_http(tmp_path_factory.mktemp("http_root")) as srv:
        yield srv


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for one test module, whose workers get the run's ``ENGINE_EXT_*`` settings and
    the tests' directory on their path (their helpers: ranks, verl's actor)."""
    ray = pytest.importorskip("ray")
    env = {k: v for k, v in os.environ.items() if k.startswith("ENGINE_EXT_")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": env})
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def s3_server():
    """moto_server on loopback; dummy AWS credentials and ENGINE_EXT_S3_ENDPOINT are set in
    os.environ and the settings while the module runs (``s3_server.env`` has them for subprocesses)."""
    from engine_ext import settings

    with pytest.MonkeyPatch.context() as mp, serve_s3() as srv, settings.override(s3_endpoint=srv.endpoint_url):
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
            mp.delenv(name, raising=False)
        for name, value in srv.env.items():
            mp.setenv(name, value)
        yield srv


@pytest.fixture
def engine_settings():
    """``engine_settings(sources=..., token=...)`` changes engine_ext's settings (what the
    ENGINE_EXT_* variables give a process at start) until the test ends."""
    import contextlib

    from engine_ext import settings

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(settings.override(**changes))


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A fresh empty bucket on the module's moto server."""
    return s3_server.make_bucket()


# --------------------------------------------------------------------------- report hooks

_MODULE_START: dict[str, float] = {}


def pytest_runtest_setup(item):
    import time

    _MODULE_START.setdefault(item.module.__name__, time.time())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test shows the tails of the logs of engine servers started since its module began."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.module.__name__ in _MODULE_START:
        for title, tail in server_report.tails_since(_MODULE_START[item.module.__name__]):
            report.sections.append((title, tail))


# xdist modes that keep every module on one worker: modules share module-scoped servers whose
# tests build on each other in order (a delta applied by one test is the base of the next).
MODULE_WHOLE_DISTS = ("no", "loadfile", "loadscope")


def pytest_configure(config):
    """In the controlling process (not an xdist worker): refuse an xdist mode that splits modules,
    and make the file the workers note their engines in."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        dist = getattr(config.option, "dist", "no")
        if getattr(config.option, "numprocesses", None) and dist not in MODULE_WHOLE_DISTS:
            raise pytest.UsageError(f"--dist {dist} splits a module's tests between workers; use one of "
                                    f"{MODULE_WHOLE_DISTS} (scripts/test.sh uses loadfile)")
        import tempfile

        fd, path = tempfile.mkstemp(prefix="engine_ext_engines_", suffix=".jsonl")
        os.close(fd)
        os.environ["ENGINE_EXT_TEST_REPORT"] = path


def pytest_collection_modifyitems(config, items):
    """Tests that start real vLLM servers (marker ``vllm``) start an engine: ``engine`` too. Modules
    that start engines go first (each in its own order): under ``--no-loadscope-reorder`` the two
    workers take the long modules first and the short ones fill in behind them."""
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(pytest.mark.engine)
    engine_files = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("engine") is not None}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in engine_files)  # stable: module order kept within


def pytest_terminal_summary(terminalreporter):
    """Which CPU kernels the engine servers of this run used (the suite must pass on AVX2-only and AMX hosts),
    and which server starts hung and were started again."""
    engines = server_report.engines()
    if engines:
        terminalreporter.section("engine CPU paths in this run")
        for desc, servers in engines.items():
            terminalreporter.write_line(f"{desc}  <- {len(servers)} server(s): {', '.join(sorted(set(servers)))}")
    hung = server_report.hangs()
    if hung:
        terminalreporter.section("server starts that hung and were started again (their stacks in these logs)")
        for log in hung:
            terminalreporter.write_line(log)
