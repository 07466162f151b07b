"""A simulated replica serves LoRA adapters as vLLM 0.32 does: loaded and unloaded over
its dev endpoints with vLLM's answers and errors, listed in `/v1/models`, served when a
request names one, cached apart from the base model and other adapters, at most
`max_loras` of them in a step's batch, and reported in `vllm:lora_requests_info`."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import aiohttp
import pytest

from dpserve.config import ConfigError
from dpserve.sim import Fleet, SimConfig, build_sim_config
from dpserve.sim.__main__ import parser
from dpserve.sim.adapters import Adapter
from tests.sim.conftest import FAST, running_engine, scrape

BS = FAST.block_size
LORA = dataclasses.replace(FAST, lora=["sql", "chat=/adapters/chat"], max_loras=2)


async def call(s: aiohttp.ClientSession, url: str, path: str, body: Any = None, *,
               raw: bytes | None = None, content_type: str = "application/json"
               ) -> tuple[int, Any]:
    data = raw if raw is not None else json.dumps(body).encode()
    async with s.post(url + path, data=data, headers={"Content-Type": content_type}) as resp:
        text = await resp.text()
        return resp.status, json.loads(text) if text.startswith("{") else text


def error(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


async def models(s: aiohttp.ClientSession, url: str) -> list[tuple[str, Any, Any]]:
    async with s.get(url + "/v1/models") as resp:
        return [(m["id"], m["root"], m["parent"]) for m in (await resp.json())["data"]]


async def test_adapters_load_unload_and_list_as_vllm_s():
    async with Fleet(n=1, config=LORA) as fleet, aiohttp.ClientSession() as s:
        url = fleet.urls[0]
        assert await models(s, url) == [(FAST.model, FAST.model, None), ("sql", "sql", FAST.model),
                                        ("chat", "/adapters/chat", FAST.model)]
        assert await call(s, url, "/v1/load_lora_adapter",
                          {"lora_name": "math", "lora_path": "/a/math"}) == (
            200, "Success: LoRA adapter 'math' added successfully.")
        assert await call(s, url, "/v1/load_lora_adapter",
                          {"lora_name": "math", "lora_path": "/a/math2"}) == (400, error(
            "The lora adapter 'math' has already been loaded. If you want to load the adapter "
            "in place, set 'load_inplace' to True.", "InvalidUserInput", 400))
        adapters = fleet[0].adapters
        assert adapters.get("math") == Adapter(name="math", path="/a/math", id=3)
        assert (await call(s, url, "/v1/load_lora_adapter", {
            "lora_name": "math", "lora_path": "/a/math2", "load_inplace": True}))[0] == 200
        assert adapters.get("math") == Adapter(name="math", path="/a/math2", id=3)
        assert await call(s, url, "/v1/unload_lora_adapter", {"lora_name": "math"}) == (
            200, "Success: LoRA adapter 'math' removed successfully.")
        assert await call(s, url, "/v1/unload_lora_adapter", {"lora_name": "math"}) == (
            404, error("The lora adapter 'math' cannot be found.", "NotFoundError", 404))
        assert (await call(s, url, "/v1/load_lora_adapter",
                           {"lora_name": "math", "lora_path": "/a/math"}))[0] == 200
        assert adapters.get("math") == Adapter(name="math", path="/a/math", id=4)  # a new id
        assert [m[0] for m in await models(s, url)] == [FAST.model, "sql", "chat", "math"]


# Bodies and what vLLM 0.32's server answers for them (its validation handler's text,
# captured from vLLM's own route models and handler under FastAPI).
BAD_BODIES = [
    ("/v1/load_lora_adapter", {"lora_name": "a"}, 400, error(
        "1 validation error:\n  {'type': 'missing', 'loc': 'body.lora_path', 'msg': 'Field "
        "required', 'input': '<dict of 1 items>'}", "Bad Request", 400, "body.lora_path")),
    ("/v1/load_lora_adapter", [], 400, error(
        "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', 'msg': "
        "'Input should be a valid dictionary or object to extract fields from', 'input': "
        "'<list of 0 items>'}", "Bad Request", 400, "body")),
    ("/v1/load_lora_adapter", {"lora_name": None, "lora_path": None}, 400, error(
        "2 validation errors:\n  {'type': 'string_type', 'loc': 'body.lora_name', 'msg': "
        "'Input should be a valid string', 'input': 'None'}\n  {'type': 'string_type', "
        "'loc': 'body.lora_path', 'msg': 'Input should be a valid string', 'input': 'None'}",
        "Bad Request", 400, "body.lora_name")),
    ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "p", "load_inplace": "maybe"},
     400, error("1 validation error:\n  {'type': 'bool_parsing', 'loc': 'body.load_inplace', "
                "'msg': 'Input should be a valid boolean, unable to interpret input', "
                "'input': 'maybe'}", "Bad Request", 400, "body.load_inplace")),
    ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "p"}, 400, error(
        "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)),
    ("/v1/load_lora_adapter", {"lora_name": FAST.model, "lora_path": "p"}, 400, error(
        f"The lora adapter '{FAST.model}' conflicts with a served base model.",
        "InvalidUserInput", 400)),
    ("/v1/unload_lora_adapter", {"lora_name": "a", "lora_int_id": "x"}, 400, error(
        "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.lora_int_id', 'msg': "
        "'Input should be a valid integer, unable to parse string as an integer', 'input': "
        "'x'}", "Bad Request", 400, "body.lora_int_id")),
    ("/v1/unload_lora_adapter", {"lora_name": ""}, 400, error(
        "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput", 400)),
]


async def test_bad_bodies_get_vllm_s_errors_and_change_nothing():
    async with Fleet(n=1, config=LORA) as fleet, aiohttp.ClientSession() as s:
        url = fleet.urls[0]
        for path, body, status, answer in BAD_BODIES:
            assert await call(s, url, path, body) == (status, answer), body
        assert await call(s, url, "/v1/load_lora_adapter", raw=b"{bad") == (400, error(
            "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.1', 'msg': 'JSON "
            "decode error', 'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting property "
            "name enclosed in double quotes'}}", "Bad Request", 400, "body.1"))
        assert await call(s, url, "/v1/unload_lora_adapter", {"lora_name": "sql"},
                          content_type="text/plain") == (400, error(
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
            "Bad Request", 400))
        assert set(fleet[0].adapters.loaded) == {"sql", "chat"}


async def test_a_request_naming_an_adapter_is_served_under_it_and_cached_apart():
    prompt = list(range(1000, 1000 + 4 * BS))

    async def complete(s: aiohttp.ClientSession, url: str, model: str) -> tuple[int, Any]:
        body = {"model": model, "prompt": prompt, "max_tokens": 1}
        async with s.post(url + "/v1/completions", json=body) as resp:
            return resp.status, await resp.json()

    async with Fleet(n=1, config=LORA) as fleet, aiohttp.ClientSession() as s:
        url, stats = fleet.urls[0], fleet[0].engine.stats
        hits = []
        for model in ("sql", "sql", "chat", FAST.model, "sql"):
            status, body = await complete(s, url, model)
            assert (status, body["model"]) == (200, model)
            hits.append(stats.prefix_cache_hits - sum(hits))
        # computed under sql, then found under sql only: 3 of its 4 blocks (the last
        # prompt token is always computed)
        assert hits == [0, 3 * BS, 0, 0, 3 * BS]
        assert await complete(s, url, "nope") == (404, error(
            f"The model `nope` does not exist. Valid aliases: {FAST.model}.",
            "NotFoundError", 404, "model"))
        await call(s, url, "/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert (await complete(s, url, "sql"))[0] == 404


async def test_at_most_max_loras_adapters_run_in_a_step_and_the_rest_keep_their_place():
    config = dataclasses.replace(FAST, max_loras=1)
    a, b = Adapter(name="a", path="a", id=1), Adapter(name="b", path="b", id=2)
    async with running_engine(config) as engine:
        first = engine.add([1] * 8, max_tokens=20, lora=a)
        second = engine.add([2] * 8, max_tokens=2, lora=b)
        third = engine.add([3] * 8, max_tokens=2)  # the base model takes no adapter slot
        fourth = engine.add([4] * 8, max_tokens=2, lora=a)
        await first.wait_beyond(0)
        assert {s.lora for s in engine.running} == {a, None}
        assert len(engine.running) == 3 and list(engine.waiting) == [second]
        while not first.finished:
            await first.wait_beyond(first.output_count)
        await second.wait_beyond(0)
        assert third.finished and fourth.finished and second.first_token_at is not None
        assert second.first_token_at > fourth.first_token_at  # type: ignore[operator]


async def test_lora_requests_info_lists_the_adapters_with_requests_in_flight():
    async with Fleet(n=1, config=LORA) as fleet:
        replica = fleet[0]
        assert not any(k.startswith("vllm:lora_requests_info") for k in await scrape(fleet.urls[0]))
        sql, chat = replica.adapters.get("sql"), replica.adapters.get("chat")
        replica.adapters.request_started(sql)
        replica.adapters.request_started(chat)
        replica.adapters.request_started(None)
        replica.adapters.request_ended(sql)
        samples = await scrape(fleet.urls[0])
        info = {k: v for k, v in samples.items() if k.startswith("vllm:lora_requests_info")}

        def key(names: str) -> str:
            return ("vllm:lora_requests_info{max_lora=2,running_lora_adapters=" + names
                    + ",waiting_lora_adapters=" + names + "}")

        # every label set it had stays, valued the time it was last current
        assert set(info) == {key("sql"), key("sql,chat"), key("chat")}
        assert info[key("chat")] >= info[key("sql,chat")] >= info[key("sql")] > 0


def test_the_lora_flag_repeats_and_bad_entries_are_refused_by_name():
    args = parser().parse_args(["--lora", "a", "--lora", "b=/p/b", "--max-loras", "2"])
    cfg = build_sim_config({"lora": args.lora, "max_loras": args.max_loras})
    assert (cfg.lora, cfg.max_loras) == (["a", "b=/p/b"], 2)
    assert build_sim_config({}, {"lora": ["x"]}).lora == ["x"]
    for bad in (["a", "a=/other"], ["=/p"], [SimConfig().model]):
        with pytest.raises(ConfigError, match="lora"):
            build_sim_config({}, {"lora": bad})
    with pytest.raises(ConfigError, match="max_loras"):
        build_sim_config({}, {"max_loras": 0})
