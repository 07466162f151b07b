"""LoRA adapters of a simulated replica, served as vLLM 0.32 serves them.

As a vLLM engine started with ``--enable-lora --max-loras N`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (`vllm/entrypoints/openai/models/serving.py`):

- `POST /v1/load_lora_adapter` ``{"lora_name", "lora_path", "load_inplace"}`` answers 200
  with the text ``Success: LoRA adapter 'NAME' added successfully.``; 400 when a field is
  empty, the name is the base model's, or the name is loaded already (unless
  `load_inplace`: then the adapter keeps its id and takes the new path). Adapter ids
  count from 1 per replica; an unloaded name loaded again gets a new one.
- `POST /v1/unload_lora_adapter` ``{"lora_name"}``: 200 ``Success: LoRA adapter 'NAME'
  removed successfully.``, 404 for a name not loaded.
- A body that is not JSON, or not one of those shapes, gets the 400 of vLLM's
  validation handler (`validation_body`): the same pydantic models, errors written as
  vLLM writes them.
- `/v1/models` lists each adapter after the base model, `parent` the base model.

Nothing is read from `lora_path`: an adapter is a name, a path and an id. What it
changes is the prefix cache's keys (a block computed under an adapter is vLLM's hash
of its tokens with ``("lora", name, path)`` as extra keys, no hit for another adapter
or the base model) and what its KV events carry (`lora_id`, `lora_name`, the name per
block in `extra_keys`). Requests under an adapter cost what base-model ones cost.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Final

import pydantic

from dpserve.sim.config import SimConfig, parse_lora

LORA_INFO_SERIES: Final = 256
"""Label sets of `vllm:lora_requests_info` kept (vLLM keeps every one it ever set)."""
_MAX_REPORTED_ERRORS: Final = 10
_MAX_INPUT_CHARS: Final = 200
_MAX_ERROR_CHARS: Final = 1000


@dataclass(frozen=True, slots=True)
class Adapter:
    """A loaded adapter: vLLM's `LoRARequest` as far as the engine cares."""

    name: str
    path: str
    id: int
    """vLLM's `lora_int_id` (the `lora_id` of KV events)."""

    @property
    def hash_keys(self) -> tuple[tuple[str, str, str]]:
        """The extra keys vLLM hashes every block of a request under it with
        (`kv_cache_utils._gen_lora_extra_hash_keys`)."""
        return (("lora", self.name, self.path),)


@dataclass(frozen=True, slots=True)
class Answer:
    """An endpoint's response: status, body, content type (None: no header, as vLLM's
    plain `Response(content=...)`)."""

    status: int
    body: bytes
    content_type: str | None = None


class _Load(pydantic.BaseModel):  # vLLM's LoadLoRAAdapterRequest
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class _Unload(pydantic.BaseModel):  # vLLM's UnloadLoRAAdapterRequest
    lora_name: str
    lora_int_id: int | None = None


class Adapters:
    """The adapters one replica serves, and the per-adapter request counts behind
    `vllm:lora_requests_info`."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.loaded: dict[str, Adapter] = {}
        self._last_id = 0
        self.in_flight: OrderedDict[str, int] = OrderedDict()
        """Adapter name -> requests under it not finished, first-seen order (vLLM's
        `LoRARequestStates`)."""
        self.info: OrderedDict[tuple[str, str, str], float] = OrderedDict()
        """`vllm:lora_requests_info` label sets (max_lora, waiting, running) -> the wall
        time they were last current, oldest first."""
        for entry in config.lora:
            name, path = parse_lora(entry)
            self._add(name, path, inplace=False)

    def get(self, model: str | None) -> Adapter | None:
        return None if model is None else self.loaded.get(model)

    def load(self, content_type: str, body: bytes) -> Answer:
        req = _validate(_Load, content_type, body)
        if isinstance(req, Answer):
            return req
        name = req.lora_name
        if not name or not req.lora_path:
            return _error(400, "Both 'lora_name' and 'lora_path' must be provided.",
                          "InvalidUserInput")
        if name == self.config.model:
            return _error(400, f"The lora adapter '{name}' conflicts with a served base "
                          "model.", "InvalidUserInput")
        if not req.load_inplace and name in self.loaded:
            return _error(400, f"The lora adapter '{name}' has already been loaded. If you "
                          "want to load the adapter in place, set 'load_inplace' to True.",
                          "InvalidUserInput")
        self._add(name, req.lora_path, inplace=req.load_inplace)
        return Answer(200, f"Success: LoRA adapter '{name}' added successfully.".encode())

    def unload(self, content_type: str, body: bytes) -> Answer:
        req = _validate(_Unload, content_type, body)
        if isinstance(req, Answer):
            return req
        name = req.lora_name
        if not name:
            return _error(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                          "InvalidUserInput")
        if name not in self.loaded:
            return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.loaded[name]
        return Answer(200, f"Success: LoRA adapter '{name}' removed successfully.".encode())

    def model_cards(self, created: int) -> list[dict[str, Any]]:
        """The adapters' `/v1/models` entries, as vLLM's `ModelCard`s for them."""
        return [{"id": a.name, "object": "model", "created": created, "owned_by": "vllm",
                 "root": a.path, "parent": self.config.model, "max_model_len": None,
                 "permission": []} for a in self.loaded.values()]

    def request_started(self, adapter: Adapter | None) -> None:
        if adapter is not None:
            self.in_flight[adapter.name] = self.in_flight.get(adapter.name, 0) + 1
        self.record()

    def request_ended(self, adapter: Adapter | None) -> None:
        if adapter is not None:
            left = self.in_flight.get(adapter.name, 1) - 1
            if left > 0:
                self.in_flight[adapter.name] = left
            else:
                self.in_flight.pop(adapter.name, None)
        self.record()

    def record(self, now: float | None = None) -> None:
        """Make the current label set the latest sample of `vllm:lora_requests_info`,
        valued the wall time, as vLLM's `set_to_current_time` after each engine step.
        vLLM lists every adapter with a request in flight under both `waiting` and
        `running` (its two dicts share their keys)."""
        names = ",".join(self.in_flight)
        key = (str(self.config.max_loras), names, names)
        self.info.pop(key, None)
        self.info[key] = time.time() if now is None else now
        while len(self.info) > LORA_INFO_SERIES:
            self.info.popitem(last=False)

    def _add(self, name: str, path: str, *, inplace: bool) -> None:
        previous = self.loaded.get(name)
        if previous is not None and inplace:
            adapter_id = previous.id
        else:
            self._last_id += 1
            adapter_id = self._last_id
        self.loaded[name] = Adapter(name=name, path=path, id=adapter_id)


def _validate(model: type[pydantic.BaseModel], content_type: str, body: bytes) -> Any:
    """The request model, or the 400 vLLM's validation handler answers for `body`."""
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        return _validation_error(["Unsupported Media Type: Only 'application/json' is allowed"])
    try:
        data = json.loads(body.decode()) if body else None
    except (UnicodeDecodeError, RecursionError):  # FastAPI's HTTPException, as vLLM answers
        return _error(400, "There was an error parsing the body", "Bad Request")
    except json.JSONDecodeError as exc:
        return _validation_error([{"type": "json_invalid", "loc": ("body", exc.pos),
                                   "msg": "JSON decode error", "input": {},
                                   "ctx": {"error": exc.msg}}])
    if data is None:  # no body, or `null`
        return _validation_error([{"type": "missing", "loc": ("body",),
                                   "msg": "Field required", "input": None}])
    try:
        return model.model_validate(data, from_attributes=True)  # as FastAPI validates
    except pydantic.ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        return _validation_error(errors)


def _validation_error(errors: list[Any]) -> Answer:
    """vLLM's `validation_exception_handler` body (`param`: the first error's field)."""
    first = errors[0]
    param = ".".join(str(p) for p in first["loc"]) if isinstance(first, dict) else None
    label = "error" if len(errors) == 1 else "errors"
    lines = [f"{len(errors)} validation {label}:"]
    lines += [f"  {_format_error(e)}" for e in errors[:_MAX_REPORTED_ERRORS]]
    if len(errors) > _MAX_REPORTED_ERRORS:
        lines.append(f"  ...and {len(errors) - _MAX_REPORTED_ERRORS} more {label}")
    return _error(400, "\n".join(lines), "Bad Request", param=param)


def _format_error(err: Any) -> str:
    if isinstance(err, dict):
        err = {**err, "loc": ".".join(str(p) for p in err["loc"])}
        if "input" in err:
            err["input"] = _summary(err["input"])
    text = str(err)
    return text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text


def _summary(value: Any) -> str:
    """A request value as vLLM's handler echoes it: containers by size, the rest as text."""
    if isinstance(value, list | tuple | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text[:_MAX_INPUT_CHARS] + "...[truncated]" if len(text) > _MAX_INPUT_CHARS else text


def _error(status: int, message: str, err_type: str, *, param: str | None = None) -> Answer:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return Answer(status, json.dumps(body).encode(), "application/json")
