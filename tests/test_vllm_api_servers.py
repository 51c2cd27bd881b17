"""vLLM with ``--api-server-count 2`` (how vLLM scales its front end), on a real CPU server: each API-server
process would hold a controller and a served state of its own, so engine_ext refuses its routes at
start-up with a message that says why and what to do, and serves nothing half-updated: every POST
and GET, whichever process it reaches, answers 503 ``unsupported``; generation still works."""
from __future__ import annotations

import pytest
import requests

pytest.importorskip("vllm")
from vllm_helpers import WARMUP_PROMPT, make_model  # noqa: E402

from engine_ext.engines.vllm.launcher import VllmServer  # noqa: E402
from engine_ext.server.protocol import ROUTE  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.engine]


def test_two_api_servers_refuse_the_update_routes_at_start_up(tmp_path):
    model = make_model(tmp_path / "model", "qwen2")
    with VllmServer(model, sources=str(tmp_path), log=tmp_path / "server.log", args=["--api-server-count", "2"]) as server:
        auth = {"Authorization": f"Bearer {server.token}"}
        answers = [requests.get(server.url + ROUTE, headers=auth, timeout=30) for _ in range(6)]  # both processes
        answers += [requests.post(server.url + ROUTE, headers=auth, json={"url": str(tmp_path / "v00000001.json")},
                                  timeout=30) for _ in range(6)]
        for r in answers:
            assert r.status_code == 503 and r.json()["reason"] == "unsupported", r.text
            assert "--api-server-count 1" in r.json()["error"]
        assert server.complete(WARMUP_PROMPT, max_tokens=2)["choices"][0]["text"] is not None
        log = (tmp_path / "server.log").read_text()
        assert log.count("the update routes refuse every request") == 2, "one refusal per API-server process"
