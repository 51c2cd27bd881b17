"""``vllm.endpoint_plugins`` entry point: ``POST``/``GET /update_weights_delta``.

Loaded in the API server process only when ``VLLM_PLUGINS`` names ``engine_ext``
(vLLM 0.32 contract: ``vllm/plugins/endpoint_plugins/interface.py``). The routes drive
a :class:`engine_ext.server.controller.Controller` whose ranks are reached through the engine
client's public methods (:class:`EngineClientRanks`); the worker-side method they call
is installed by the general plugin.
"""
from __future__ import annotations

import logging
import os
from argparse import Namespace

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from ...server.controller import Auth, Controller, initial_version
from ...server.http import bounded_body, get_answer, post_answer, wants_audit
from ...server.protocol import ROUTE, RankReply
from . import compat
from .worker import RPC_METHOD

log = logging.getLogger("engine_ext")


class EngineClientRanks:
    """:class:`engine_ext.server.transaction.Ranks` over vLLM's ``EngineClient`` (the API server's handle on the engine)."""

    def __init__(self, client):
        self.client = client

    async def call(self, op: str, **kwargs) -> list[RankReply]:
        wire = await self.client.collective_rpc(RPC_METHOD, args=(op,), kwargs=kwargs)
        return [RankReply.from_wire(w) for w in wire]

    async def pause(self, mode: str) -> None:
        # The caches are reset after the apply instead (clear_cache would drop the
        # KV of requests frozen by mode "keep").
        await self.client.pause_generation(mode=mode, clear_cache=False)

    async def resume(self) -> None:
        await self.client.resume_generation()

    async def after_update(self, version: int) -> None:
        if not await self.client.reset_prefix_cache():
            log.warning("engine_ext: prefix cache reset refused by the engine after v%s", version)
        await self.client.update_weight_version(str(version))


def _controller(request: Request):
    async def get() -> Controller | None:
        return getattr(request.app.state, "engine_ext", None)

    return get


def _auth(request: Request) -> Auth:
    """Set by init_state (with vLLM's --api-key); before that, from the settings alone."""
    return getattr(request.app.state, "engine_ext_auth", None) or Auth.from_settings()


async def post_update(request: Request) -> JSONResponse:
    status, body = await post_answer(_auth(request), _controller(request), request.headers.get("authorization"),
                                     bounded_body(request))
    return JSONResponse(body, status)


async def get_update(request: Request) -> JSONResponse:
    status, body = await get_answer(_auth(request), _controller(request), request.headers.get("authorization"),
                                    wants_audit(request.query_params))
    return JSONResponse(body, status)


class EndpointPlugin:
    """Factory object per the vLLM endpoint-plugin protocol."""

    name = "engine_ext"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        router = APIRouter()
        router.add_api_route(ROUTE, post_update, methods=["POST"])
        router.add_api_route(ROUTE, get_update, methods=["GET"])
        app.include_router(router)

    async def init_state(self, engine_client, state, args: Namespace) -> None:
        # vLLM's own --api-key (or VLLM_API_KEY) opens our route too; its middleware guards /v1 only.
        state.engine_ext_auth = Auth.from_settings(engine_tokens=compat.api_keys(args))
        if engine_client is None:
            return
        model_dir = getattr(args, "model", None)
        ctl = Controller(EngineClientRanks(engine_client),
                         version=initial_version(model_dir if model_dir and os.path.isdir(model_dir) else None))
        state.engine_ext = ctl
        try:
            await ctl.start()
        except Exception:  # noqa: BLE001 - keep serving; the route answers with the reason
            log.exception("engine_ext: start-up probe failed; /update_weights_delta will refuse updates")
        ctl.start_following()  # ENGINE_EXT_FOLLOW: pull mode, in the API server's event loop
