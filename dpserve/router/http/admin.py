"""The router's control plane under `/admin`: the replica list, drain and undrain.

Kept apart from routing: these handlers only move replicas between states in
the pool; the policy sees the result through `ReplicaPool.ready()`. Access is
checked by `dpserve.router.http.auth.Authenticate` (admin key, or loopback only).

- `GET  /admin/replicas` — every replica with its state, load and version.
- `POST /admin/replicas/{id}/drain` — stop sending it new requests; with
  `{"wait_s": S}` also wait up to S seconds for its in-flight requests to end
  (`"drained": true` once none is left); with `"move_streams": true`, the
  streams still running then move to other replicas (`dpserve.router.fleet.live`;
  `"moved_streams"` says how many, `"restarted_streams"` how many of them had sent
  nothing yet and started over), as before a scale-down.
- `POST /admin/replicas/{id}/undrain` — health-check it now and put it back
  into rotation when healthy.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dpserve.router.errors import error_response
from dpserve.router.fleet.health import HealthChecker
from dpserve.router.fleet.live import NONE_MOVING, LiveStreams
from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState
from dpserve.router.http.admin_body import read_json_object

MAX_WAIT_S = 3600.0
MOVED_LEAVE_S = 5.0
"""How long moved streams get to leave (each needs a continuation's first byte)."""


def describe(replica: Replica, now: float | None = None) -> dict[str, Any]:
    now = time.monotonic() if now is None else now
    return {
        "id": replica.id, "url": replica.url, "device": replica.device,
        "state": replica.state.value, "state_for_s": round(now - replica.state_since, 3),
        "in_flight": replica.in_flight, "weight_version": replica.weight_version,
        "models": sorted(replica.models), "last_error": replica.last_error,
    }


def admin_routes(pool: ReplicaPool, health: HealthChecker, streams: LiveStreams
                 ) -> list[Route]:

    def find(request: Request) -> Replica | Response:
        replica_id = request.path_params["replica_id"]
        replica = pool.get(replica_id)
        if replica is None:
            return error_response(404, f"no replica {replica_id!r}", param="replica_id")
        return replica

    async def replicas(request: Request) -> Response:
        return JSONResponse({"replicas": [describe(r) for r in pool]})

    async def drain(request: Request) -> Response:
        replica = find(request)
        if isinstance(replica, Response):
            return replica
        body = await read_json_object(request, fields=("wait_s", "move_streams"))
        if isinstance(body, Response):
            return body
        wait_s, move = body.get("wait_s", 0), body.get("move_streams", False)
        if (not isinstance(wait_s, int | float) or isinstance(wait_s, bool)
                or not 0 <= wait_s <= MAX_WAIT_S):
            return error_response(400, f"wait_s must be a number in 0..{MAX_WAIT_S:g}",
                                  param="wait_s")
        if not isinstance(move, bool):
            return error_response(400, "move_streams must be true or false",
                                  param="move_streams")
        if replica.state is ReplicaState.RELOADING:
            return error_response(409, f"replica {replica.id} is being reloaded")
        pool.set_state(replica, ReplicaState.DRAINING, "drained by admin")
        drained = await pool.wait_idle(replica, wait_s)
        answer: dict[str, Any] = {}
        if move:
            moved = streams.evict(replica.id) if not drained else NONE_MOVING
            answer["moved_streams"] = moved.total
            answer["restarted_streams"] = moved.restarting  # of those: had sent nothing yet
            if moved:
                drained = await pool.wait_idle(replica, MOVED_LEAVE_S)
        return JSONResponse({**describe(replica), "drained": drained, **answer})

    async def undrain(request: Request) -> Response:
        replica = find(request)
        if isinstance(replica, Response):
            return replica
        if replica.state is ReplicaState.RELOADING:
            return error_response(409, f"replica {replica.id} is being reloaded")
        if replica.state is ReplicaState.DRAINING:
            pool.set_state(replica, ReplicaState.STARTING, "undrained by admin")
            await health.check_one(replica)
        return JSONResponse(describe(replica))

    return [
        Route("/admin/replicas", replicas, methods=["GET"]),
        Route("/admin/replicas/{replica_id}/drain", drain, methods=["POST"]),
        Route("/admin/replicas/{replica_id}/undrain", undrain, methods=["POST"]),
    ]
