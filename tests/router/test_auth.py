from __future__ import annotations

import httpx
import pytest

from dpserve.config import ConfigError, build_router_config
from tests.conftest import running_router
from tests.fakes import MODEL

KEY = "s3cret-key-for-tests"
BODY = {"model": MODEL, "prompt": "hi"}


async def test_api_paths_need_the_key_and_probes_do_not(fake_replicas):
    a = await fake_replicas("a")
    async with running_router([a.url], api_key=KEY) as (base, _), httpx.AsyncClient() as c:
        missing = await c.post(base + "/v1/completions", json=BODY)
        wrong = await c.post(base + "/v1/completions", json=BODY,
                             headers={"authorization": "Bearer nope"})
        right = await c.post(base + "/v1/completions", json=BODY,
                             headers={"authorization": f"Bearer {KEY}"})
        models = await c.get(base + "/v1/models")
        probes = [await c.get(base + p) for p in ("/health", "/ready", "/metrics")]
    assert missing.status_code == wrong.status_code == models.status_code == 401
    assert missing.json()["error"]["type"] == "UnauthorizedError"
    assert right.status_code == 200
    assert [p.status_code for p in probes] == [200, 200, 200]
    assert len(a.requests) == 1  # refused requests never reached a replica


def test_the_key_comes_from_env_or_a_file_and_is_never_shown(tmp_path):
    cfg = build_router_config({}, {}, {"DPSERVE_API_KEY": KEY})
    assert cfg.api_key == KEY
    assert KEY not in repr(cfg)
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    assert build_router_config({}, {}, {"DPSERVE_API_KEY_FILE": str(key_file)}).api_key == KEY


@pytest.mark.parametrize(("env", "message"), [
    ({"DPSERVE_API_KEY": "short"}, "router.api_key: must be at least 8 characters"),
    ({"DPSERVE_API_KEY_FILE": "/nonexistent/key"}, "router.api_key_file: cannot read"),
])
def test_bad_keys_are_refused(env, message):
    with pytest.raises(ConfigError) as exc:
        build_router_config({}, {}, env)
    assert message in str(exc.value)
    assert "short" not in str(exc.value)
