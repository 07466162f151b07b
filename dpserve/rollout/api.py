"""`/admin/deploy`: start a rolling hot-load and follow it.

- `POST /admin/deploy` `{"checkpoint": "/abs/OUTPUT/step-000120", "batch": 1,
  "canary_prompt": "...", "drain_wait_s": 0, "ready_timeout_s": 900}` validates
  the checkpoint (answering 400/409/422 in the OpenAI error envelope, with no
  replica touched), then answers 202 with the deploy's record while it rolls out
  in the background. 409 while another deploy runs. With `"name": "NAME"` the
  checkpoint is a LoRA adapter, served as model NAME beside the base
  (`dpserve.rollout.adapter_deploy`).
- `GET /admin/deploy/{id}` — that deploy's record (state, per-replica phase, events).
- `GET /admin/deploy` — the deploy in progress, else the last one.

The checkpoint path is read on the router's machine (and loaded by the
replicas), so it must be absolute; `dpserve deploy` resolves it. Access control
is `/admin`'s (see dpserve.router.http.auth).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dpserve.rollout.progress import DEPLOY_FIELDS, DeployOptions
from dpserve.rollout.rollout import Rollout
from dpserve.rollout.validate import Refused
from dpserve.router.errors import error_response
from dpserve.router.http.admin_body import read_json_object


def deploy_routes(rollout: Rollout) -> list[Route]:
    async def start(request: Request) -> Response:
        body = await read_json_object(request, fields=DEPLOY_FIELDS)
        if isinstance(body, Response):
            return body
        checkpoint = body.get("checkpoint")
        if not isinstance(checkpoint, str) or not checkpoint.startswith("/"):
            return error_response(400, "checkpoint must be an absolute path to a checkpoint "
                                       "directory", param="checkpoint")
        name = body.get("name")
        if name is not None and not isinstance(name, str):
            return error_response(400, "name must be a string: the model name clients use "
                                       "for the adapter", param="name")
        try:
            options = DeployOptions.from_json(body)
            progress = await rollout.start(checkpoint, options, name=name)
        except Refused as exc:
            return error_response(exc.status, exc.message, param=exc.param)
        return JSONResponse(progress.to_json(), status_code=202,
                            headers={"location": f"/admin/deploy/{progress.id}"})

    async def show(request: Request) -> Response:
        deploy_id = request.path_params["deploy_id"]
        progress = rollout.get(deploy_id)
        if progress is None:
            return error_response(404, f"no deploy {deploy_id!r}", param="deploy_id")
        return JSONResponse(progress.to_json())

    async def latest(request: Request) -> Response:
        progress = rollout.latest()
        if progress is None:
            return error_response(404, "no deploy yet")
        return JSONResponse(progress.to_json())

    return [
        Route("/admin/deploy", start, methods=["POST"]),
        Route("/admin/deploy", latest, methods=["GET"]),
        Route("/admin/deploy/{deploy_id}", show, methods=["GET"]),
    ]
