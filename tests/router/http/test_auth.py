from __future__ import annotations

import httpx
import pytest

from dpserve.config import ConfigError, build_router_config
from dpserve.router.http.auth import Authenticate, is_local, networks
from tests.conftest import running_router
from tests.fakes import MODEL

KEY = "s3cret-key-for-tests"
OTHER_KEY = "another-key-being-rotated-in"
ADMIN_KEY = "admin-key-long-enough-for-tests"
BODY = {"model": MODEL, "prompt": "hi"}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_api_paths_need_a_key_and_probes_do_not(fake_replicas):
    a = await fake_replicas("a")
    async with (running_router([a.url], api_keys=[KEY, OTHER_KEY]) as (base, _),
                httpx.AsyncClient() as c):
        missing = await c.post(base + "/v1/completions", json=BODY)
        wrong = await c.post(base + "/v1/completions", json=BODY, headers=bearer("nope"))
        raw = await c.post(base + "/v1/completions", json=BODY, headers={"authorization": KEY})
        right = await c.post(base + "/v1/completions", json=BODY, headers=bearer(KEY))
        rotated = await c.post(base + "/v1/completions", json=BODY, headers=bearer(OTHER_KEY))
        models = await c.get(base + "/v1/models")
        probes = [await c.get(base + p) for p in ("/health", "/ready", "/metrics")]
    assert missing.status_code == wrong.status_code == raw.status_code == 401
    assert models.status_code == 401
    assert missing.json()["error"]["type"] == "UnauthorizedError"
    assert missing.headers["www-authenticate"] == "Bearer"
    assert right.status_code == rotated.status_code == 200
    assert [p.status_code for p in probes] == [200, 200, 200]
    assert len(a.requests) == 2  # refused requests never reached a replica


async def test_admin_needs_the_admin_key_and_api_keys_do_not_open_it(fake_replicas):
    a = await fake_replicas("a")
    async with (running_router([a.url], api_keys=[KEY], admin_key=ADMIN_KEY) as (base, _),
                httpx.AsyncClient() as c):
        none = await c.get(base + "/admin/replicas")
        api = await c.get(base + "/admin/replicas", headers=bearer(KEY))
        admin = await c.get(base + "/admin/replicas", headers=bearer(ADMIN_KEY))
        admin_on_api = await c.post(base + "/v1/completions", json=BODY,
                                    headers=bearer(ADMIN_KEY))
    assert none.status_code == api.status_code == 401
    assert "admin key" in api.json()["error"]["message"]
    assert admin.status_code == 200
    assert [r["id"] for r in admin.json()["replicas"]] == ["r0"]
    assert admin_on_api.status_code == 401  # the two keys open separate doors


async def test_without_an_admin_key_admin_answers_loopback_clients_only():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"admin"})

    async def call(client_host: str, path: str) -> int:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "path": path, "headers": [], "client": (client_host, 4242)}
        await Authenticate(app, api_keys=None, admin_key=None)(scope, None, send)
        return sent[0]["status"]

    assert await call("127.0.0.1", "/admin/replicas") == 200
    assert await call("::1", "/admin/replicas") == 200
    assert await call("10.1.2.3", "/admin/replicas") == 403
    assert await call("10.1.2.3", "/admin") == 403
    assert await call("10.1.2.3", "/administrator") == 200  # not the admin prefix
    assert await call("10.1.2.3", "/v1/completions") == 200  # no API key configured


@pytest.mark.parametrize(("host", "local"), [
    ("127.0.0.1", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("127.0.0.6", False), ("127.8.9.1", False), ("::ffff:127.0.0.6", False),
    ("10.0.0.1", False), ("localhost", False), ("", False), (None, False)])
def test_local_is_decided_by_address_not_name(host, local):
    assert is_local(host, networks(["127.0.0.1", "::1"])) is local


def test_local_addresses_can_be_widened_to_loopback_networks():
    assert is_local("127.0.0.6", networks(["127.0.0.0/8"]))
    assert not is_local("::2", networks(["127.0.0.0/8", "::1"]))


def test_keys_come_from_env_or_a_file_and_are_never_shown(tmp_path):
    cfg = build_router_config({}, {}, {"DPSERVE_API_KEY": KEY, "DPSERVE_ADMIN_KEY": ADMIN_KEY})
    assert cfg.api_keys == [KEY] and cfg.admin_key == ADMIN_KEY
    assert KEY not in repr(cfg) and ADMIN_KEY not in repr(cfg)
    many = build_router_config({}, {}, {"DPSERVE_API_KEYS": f"{KEY}, {OTHER_KEY}"})
    assert many.api_keys == [KEY, OTHER_KEY]
    key_file = tmp_path / "keys"
    key_file.write_text(f"# rotated 2026-11\n{KEY}\n\n{OTHER_KEY}\n")
    admin_file = tmp_path / "admin"
    admin_file.write_text(ADMIN_KEY + "\n")
    from_files = build_router_config({"api_key_file": str(key_file),
                                      "admin_key_file": str(admin_file)}, {}, {})
    assert from_files.api_keys == [KEY, OTHER_KEY] and from_files.admin_key == ADMIN_KEY


@pytest.mark.parametrize(("env", "message"), [
    ({"DPSERVE_API_KEY": "short"}, "router.api_key: must be at least 8 characters"),
    ({"DPSERVE_API_KEYS": f"{KEY},short"}, "router.api_key: must be at least 8 characters"),
    ({"DPSERVE_API_KEY_FILE": "/nonexistent/key"}, "router.api_key_file: cannot read"),
    ({"DPSERVE_ADMIN_KEY": "short-admin"}, "router.admin_key: must be at least 16 characters"),
    ({"DPSERVE_API_KEY": ADMIN_KEY, "DPSERVE_ADMIN_KEY": ADMIN_KEY},
     "router.admin_key: must differ from every API key"),
])
def test_bad_keys_are_refused_without_showing_them(env, message):
    with pytest.raises(ConfigError) as exc:
        build_router_config({}, {}, env)
    assert message in str(exc.value)
    assert "short" not in str(exc.value) and ADMIN_KEY not in str(exc.value)


def test_a_key_file_with_only_comments_is_refused(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# nothing yet\n\n")
    with pytest.raises(ConfigError, match="holds no key"):
        build_router_config({"api_key_file": str(key_file)}, {}, {})
