"""``vllm.endpoint_plugins`` entry point: ``POST``/``GET /update_weights_delta``, and vLLM's own
weight-transfer routes when the server's backend is engine_ext.

Loaded in the API server process only when ``VLLM_PLUGINS`` names ``engine_ext``
(vLLM 0.32 contract: ``vllm/plugins/endpoint_plugins/interface.py``). The routes drive
a :class:`engine_ext.server.controller.Controller` whose ranks are reached through the engine
client's public methods (:class:`EngineClientRanks`); the worker-side method they call
is installed by the general plugin.

With ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config '{"backend": "engine_ext"}'``
(or ``delta``), vLLM serves ``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights`` and ``/finish_weight_update``, which would reach the backend in the
workers: a second driver with a served state of its own. :class:`NativeDoor` takes those
routes over, so that they run through this process's one controller: the same lock,
served state, follower, metrics and history as ``POST /update_weights_delta``. Endpoint
plugins attach after vLLM's routers, so ours are put ahead of vLLM's in the app's route
list (Starlette takes the first match). The workers' weight-update session (vLLM keeps
one) still opens and closes through the engine client.
"""

from __future__ import annotations

import json
import logging
import os
from argparse import Namespace

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from ...errors import DeltaError, UnsupportedError
from ...server import transfer_api
from ...server.controller import Auth, Controller, Policy, error_answer, initial_version
from ...server.http import bounded_body, cold_checkpoint, get_answer, post_answer, wants_audit
from ...server.protocol import ROUTE, RankReply, RequestError
from . import compat
from .worker import BACKEND_NAMES, RPC_METHOD

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


class SplitFrontEnd(UnsupportedError):
    """vLLM serves through more than one API-server process (``--api-server-count`` > 1): each would hold a
    controller and a served state of its own, and an update or a status request reaches one of them."""


def split_front_end(args: Namespace) -> SplitFrontEnd | None:
    """The refusal for a server started with several API-server processes (None: one, the supported case)."""
    count = getattr(args, "api_server_count", None) or 1
    if count <= 1:
        return None
    return SplitFrontEnd(
        f"engine_ext needs one API-server process: this server runs {count} (--api-server-count), "
        "and each would keep its own served state (version, fingerprints, history, lock), so an "
        "update or a status request would reach only one of them; start vLLM with "
        "--api-server-count 1 (updates pause generation for milliseconds, the front end is not "
        "their bottleneck)"
    )


def _controller(request: Request):
    async def get() -> Controller | None:
        refused = getattr(request.app.state, "engine_ext_refused", None)
        if refused is not None:
            raise refused
        return getattr(request.app.state, "engine_ext", None)

    return get


def _auth(request: Request) -> Auth:
    """Set by init_state (with vLLM's --api-key); before that, from the settings alone."""
    return getattr(request.app.state, "engine_ext_auth", None) or Auth.from_settings()


async def post_update(request: Request) -> JSONResponse:
    status, body = await post_answer(
        _auth(request), _controller(request), request.headers.get("authorization"), bounded_body(request)
    )
    return JSONResponse(body, status)


async def get_update(request: Request) -> JSONResponse:
    status, body = await get_answer(
        _auth(request),
        _controller(request),
        request.headers.get("authorization"),
        wants_audit(request.query_params),
        cold_checkpoint(request.query_params),
    )
    door = getattr(request.app.state, "engine_ext_native", None)
    if status == 200 and door is not None:
        body["native"] = door.status()
    return JSONResponse(body, status)


# --------------------------------------------------------------------------- vLLM's weight-transfer routes


class SessionError(DeltaError):
    """A weight-update session call out of order (vLLM's workers keep one session at a time)."""

    reason, http_status = "session", 409


class NativeDoor:
    """vLLM's weight-transfer routes on a server whose backend is engine_ext, through the one controller.

    ``init_weight_transfer_engine`` narrows what this door accepts (:func:`transfer_api.narrow`);
    ``start_weight_update`` opens vLLM's session on the workers; ``update_weights`` runs the
    controller's update (the transaction of ``POST /update_weights_delta``, waiting its turn under
    the same lock); ``finish_weight_update`` closes the session, sets vLLM's weight version and
    records it beside engine_ext's version. A refusal answers the route's status and
    ``{"ok": false, "reason", "error"}``, changes nothing served, and ends the session (as
    vLLM's workers do when an update raises). Like every dev-mode route, these take no token:
    what keeps them safe is that only signed versions from allowed sources are applied.
    """

    def __init__(self, engine_client, server: Policy):
        self.engine_client, self.server = engine_client, server
        self.policy = server
        self.session = False

    async def init(self, ctl: Controller, body: dict) -> dict:
        self.policy = transfer_api.narrow(body.get("init_info"), self.server)  # refused: nothing changed
        return {"message": "Weight transfer initialized", **transfer_api.describe(self.policy, self.server)}

    async def start(self, ctl: Controller, body: dict) -> dict:
        if self.session:
            raise SessionError(
                "start_weight_update called while a weight update is active; call finish_weight_update first"
            )
        try:
            await self.engine_client.start_weight_update()
        except RuntimeError as e:
            raise SessionError(str(e)[:500]) from None
        self.session = True
        return {"message": "Weight update started"}

    async def update(self, ctl: Controller, body: dict) -> dict:
        if not self.session:
            raise SessionError("start_weight_update must be called before update_weights")
        try:
            answer = await ctl.update(transfer_api.update_request(body.get("update_info")), self.policy)
        except BaseException:
            await self._end_session()
            raise
        return {"message": "Weights updated", **answer}

    async def finish(self, ctl: Controller, body: dict) -> dict:
        label = body.get("weight_version")
        if label is not None and (not isinstance(label, str) or len(label) > 256):
            raise RequestError("weight_version must be a string of at most 256 characters")
        if not self.session:
            raise SessionError("finish_weight_update called without a matching start_weight_update")
        self.session = False
        await self.engine_client.finish_weight_update(label)  # the workers' session; vLLM's weight version
        if label is not None:
            await ctl.set_label(label)
        return {"message": "Weight update finished", "version": ctl.version, "weight_version": label}

    async def _end_session(self) -> None:
        """After a refused or failed update: close the workers' session, as vLLM does when an update raises."""
        self.session = False
        try:
            await self.engine_client.finish_weight_update(None)
        except Exception as e:  # noqa: BLE001 - the update's own error is what the caller needs
            log.warning("engine_ext: closing vLLM's weight-update session after a refused update failed: %s", e)

    def status(self) -> dict:
        return {"session": self.session, **transfer_api.describe(self.policy, self.server)}


NATIVE_ROUTES = {
    "/init_weight_transfer_engine": NativeDoor.init,
    "/start_weight_update": NativeDoor.start,
    "/update_weights": NativeDoor.update,
    "/finish_weight_update": NativeDoor.finish,
}


def native_route(step):
    async def handle(request: Request) -> JSONResponse:
        try:
            refused = getattr(request.app.state, "engine_ext_refused", None)
            if refused is not None:
                raise refused
            door, ctl = (
                getattr(request.app.state, "engine_ext_native", None),
                getattr(request.app.state, "engine_ext", None),
            )
            if door is None or ctl is None:
                return JSONResponse(
                    {"ok": False, "reason": "unavailable", "error": "engine_ext is not initialised on this server"}, 503
                )
            raw = await bounded_body(request)()  # never held whole past the limit
            try:
                body = json.loads(raw) if raw.strip() else {}
            except ValueError as e:
                raise RequestError(f"body is not valid JSON: {str(e)[:120]}") from None
            if not isinstance(body, dict):
                raise RequestError("body must be a JSON object")
            return JSONResponse(await step(door, ctl, body), 200)
        except Exception as e:  # noqa: BLE001 - every failure is an answer with a status
            status, answer = error_answer(e)
            log.warning("engine_ext: %s refused/failed (%s): %s", request.url.path, status, answer["error"])
            return JSONResponse(answer, status)

    return handle


def takes_over_native_routes(app: FastAPI) -> bool:
    """vLLM serves its weight-transfer routes (dev mode) and the server's backend is engine_ext."""
    args = getattr(app.state, "args", None)
    return compat.dev_mode() and compat.weight_transfer_backend(args) in BACKEND_NAMES


def put_ahead(app: FastAPI, ours: list[APIRoute]) -> None:
    """Move each of ``ours`` in front of any earlier route with its path and a common method (vLLM's):
    Starlette answers with the first route that matches."""
    routes = app.router.routes
    for route in ours:
        routes.remove(route)
        at = next(
            (
                i
                for i, r in enumerate(routes)
                if isinstance(r, APIRoute) and r.path == route.path and r.methods & route.methods
            ),
            len(routes),
        )
        routes.insert(at, route)


class EndpointPlugin:
    """Factory object per the vLLM endpoint-plugin protocol."""

    name = "engine_ext"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        router = APIRouter()
        router.add_api_route(ROUTE, post_update, methods=["POST"])
        router.add_api_route(ROUTE, get_update, methods=["GET"])
        app.include_router(router)
        if takes_over_native_routes(app):
            n = len(app.router.routes)
            for path, step in NATIVE_ROUTES.items():
                app.add_api_route(path, native_route(step), methods=["POST"])
            put_ahead(app, [r for r in app.router.routes[n:] if isinstance(r, APIRoute)])
            log.info(
                "engine_ext: vLLM's weight-transfer routes %s run through engine_ext's controller", list(NATIVE_ROUTES)
            )

    async def init_state(self, engine_client, state, args: Namespace) -> None:
        # vLLM's own --api-key (or VLLM_API_KEY) opens our route too; its middleware guards /v1 only.
        state.engine_ext_auth = Auth.from_settings(engine_tokens=compat.api_keys(args))
        if engine_client is None:
            return
        state.engine_ext_refused = split_front_end(args)
        if state.engine_ext_refused is not None:  # refused at start-up: no controller, no probe, no follower
            log.error("engine_ext: the update routes refuse every request: %s", state.engine_ext_refused)
            return
        model_dir = getattr(args, "model", None)
        ctl = Controller(
            EngineClientRanks(engine_client),
            version=initial_version(model_dir if model_dir and os.path.isdir(model_dir) else None),
        )
        state.engine_ext = ctl
        if compat.dev_mode() and compat.weight_transfer_backend(args) in BACKEND_NAMES:
            state.engine_ext_native = NativeDoor(engine_client, Policy(ctl.sources, ctl.trust))
        try:
            await ctl.start()
        except Exception:
            log.exception("engine_ext: start-up probe failed; /update_weights_delta will refuse updates")
        ctl.start_following()  # ENGINE_EXT_FOLLOW: pull mode, in the API server's event loop
