"""The vLLM dev endpoints a hot-load needs, for one replica (control plane: httpx).

Checked against vLLM 0.32 (`VLLM_SERVER_DEV_MODE=1`):

- `POST /pause?mode=keep` freezes in-flight requests and queues new ones
  (the default `mode=abort` would end them with `finish_reason: abort`);
- `POST /collective_rpc` `{"method": "reload_weights", "kwargs": {"weights_path",
  "is_checkpoint_format": true}}` copies new weights into the loaded model;
- `POST /reset_prefix_cache?reset_running_requests=true` drops cached KV computed
  with the old weights; frozen requests are preempted and recomputed, not failed;
- `POST /resume`; `POST /update_weight_version` `{"new_version"}`;
- adapters (`--enable-lora`, `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`):
  `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}` loads one into the
  engine (400 if the name is taken, 500 with the engine's reason if it cannot
  load; 404 when run-time updating is off: the route does not exist);
  `POST /v1/unload_lora_adapter` `{"lora_name"}` takes the name away (the
  engine's host-memory cache drops its weights least-recently-used first).

A canary request while paused would be queued like any other, so the canary
runs after `/resume`, while the router still keeps new requests away.
Every failure is an `EngineAdminError` naming the step and the replica's answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import httpx

STEP_TIMEOUT_S = 60.0
RELOAD_TIMEOUT_S = 900.0  # a large model is read from disk (or a network volume)
CANARY_MAX_TOKENS = 8


class EngineAdminError(Exception):
    """A hot-load step failed on a replica. `non_finite` is set when the replica
    computed NaN or infinity: its KV cache memory may then hold non-finite values
    that a later reload does not clear, so only a restart makes it trustworthy."""

    def __init__(self, step: str, message: str, *, non_finite: bool = False) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step
        self.non_finite = non_finite


@dataclass(frozen=True)
class CanaryResult:
    text: str
    token_logprobs: list[float]


class EngineAdmin:
    """Hot-load calls against one replica's base URL, over a client the caller owns."""

    def __init__(self, client: httpx.AsyncClient, url: str, *,
                 reload_timeout_s: float = RELOAD_TIMEOUT_S) -> None:
        self._client = client
        self._url = url.rstrip("/")
        self._reload_timeout_s = reload_timeout_s

    async def pause(self) -> None:
        await self._call("pause", "/pause", params={"mode": "keep"})

    async def reload_weights(self, weights_path: str) -> None:
        await self._call("reload", "/collective_rpc", json={
            "method": "reload_weights",
            "kwargs": {"weights_path": weights_path, "is_checkpoint_format": True},
        }, limit_s=self._reload_timeout_s)

    async def reset_prefix_cache(self) -> None:
        body = await self._call("reset_prefix_cache", "/reset_prefix_cache",
                                params={"reset_running_requests": "true"})
        if not (isinstance(body, dict) and body.get("success") is True):
            raise EngineAdminError("reset_prefix_cache", f"the replica answered {body!r}")

    async def resume(self) -> None:
        await self._call("resume", "/resume")

    async def set_weight_version(self, version: str) -> None:
        await self._call("update_weight_version", "/update_weight_version",
                         json={"new_version": version})

    async def load_lora(self, name: str, path: str) -> None:
        """Load the adapter directory `path` as model `name`; EngineAdminError naming
        `--enable-lora` when the replica cannot take adapters at run time."""
        try:
            await self._call("load_lora_adapter", "/v1/load_lora_adapter",
                             json={"lora_name": name, "lora_path": path},
                             limit_s=self._reload_timeout_s)
        except EngineAdminError as exc:
            if "HTTP 404" in str(exc):
                raise EngineAdminError(
                    "load_lora_adapter", "the replica does not load adapters at run time: "
                    "start it with --enable-lora (dpserve serve --enable-lora, or vLLM's "
                    "--enable-lora with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)") from None
            raise

    async def unload_lora(self, name: str) -> None:
        await self._call("unload_lora_adapter", "/v1/unload_lora_adapter",
                         json={"lora_name": name})

    async def canary(self, model: str, prompt: str) -> CanaryResult:
        """A short greedy completion: it must end normally with finite logprobs."""
        try:
            resp = await self._client.post(self._url + "/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": CANARY_MAX_TOKENS,
                "temperature": 0, "logprobs": 1,
            }, timeout=STEP_TIMEOUT_S)
        except httpx.HTTPError as exc:
            raise EngineAdminError("canary", _describe(exc)) from None
        body = _json(resp)
        if resp.status_code != 200:
            message = _error_message(body, resp)
            # vLLM answers 400 when it cannot encode NaN/inf logprobs as JSON.
            raise EngineAdminError("canary", f"HTTP {resp.status_code}: {message}",
                                   non_finite="out of range float" in message.lower())
        try:
            choice = body["choices"][0]
            text = choice["text"]
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            finish = choice["finish_reason"]
        except (KeyError, IndexError, TypeError, ValueError):
            raise EngineAdminError("canary", f"unexpected answer {str(body)[:200]}") from None
        if not logprobs:
            raise EngineAdminError("canary", "no token was generated")
        if not all(math.isfinite(lp) for lp in logprobs):
            raise EngineAdminError("canary", f"non-finite logprobs {logprobs}",
                                   non_finite=True)
        if any(lp > 1e-4 for lp in logprobs):
            raise EngineAdminError("canary", f"logprobs above 0: {logprobs}")
        if finish not in ("length", "stop"):
            raise EngineAdminError("canary", f"finish_reason {finish!r}")
        return CanaryResult(text=text, token_logprobs=logprobs)

    async def _call(self, step: str, path: str, *, json: Any = None,
                    params: dict[str, str] | None = None,
                    limit_s: float = STEP_TIMEOUT_S) -> Any:
        try:
            resp = await self._client.post(self._url + path, json=json, params=params,
                                           timeout=limit_s)
        except httpx.HTTPError as exc:
            raise EngineAdminError(step, _describe(exc)) from None
        body = _json(resp)
        if resp.status_code != 200:
            raise EngineAdminError(step, f"HTTP {resp.status_code}: "
                                         f"{_error_message(body, resp)}")
        return body


def _json(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return None


def _error_message(body: Any, resp: httpx.Response) -> str:
    """vLLM's OpenAI envelope, FastAPI's `detail`, the dev endpoints' `error`, or the text."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("error", "detail"):
            if key in body:
                return str(body[key])
    return resp.text[:300] or "(empty body)"


def _describe(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer in time ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
