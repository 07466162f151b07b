"""Who counts as an admin when the router is reachable from a network.

Without an admin key, `/admin/*` trusts loopback clients. That trust must not be
borrowed: not through proxy headers nobody configured, and not by a router that
listens beyond loopback (a sidecar or NAT makes remote clients look local).
"""

from __future__ import annotations

import httpx
import pytest

from dpserve.config import ConfigError, build_router_config
from dpserve.replicas.launcher import free_port
from tests.conftest import running_router

ADMIN_KEY = "admin-key-long-enough-for-tests"


@pytest.mark.parametrize("flags", [{"host": "0.0.0.0"}, {"host": "::"},
                                   {"admin_port": 9001, "admin_host": "0.0.0.0"}])
def test_a_router_exposed_beyond_loopback_refuses_to_start_without_an_admin_key(flags):
    with pytest.raises(ConfigError, match=r"router.admin_key: required when /admin listens "
                                          r"beyond loopback.*--insecure-admin"):
        build_router_config(flags, env={})


@pytest.mark.parametrize("flags, env", [
    ({"host": "0.0.0.0"}, {"DPSERVE_ADMIN_KEY": ADMIN_KEY}),
    ({"host": "0.0.0.0", "insecure_admin": True}, {}),
    ({"host": "0.0.0.0", "admin_port": 9001}, {}),  # admin on loopback only
    ({"host": "localhost"}, {}),
])
def test_an_exposed_router_starts_with_a_key_an_opt_in_or_a_loopback_admin_port(flags, env):
    build_router_config(flags, env=env)


def test_trusted_proxies_must_be_addresses_or_networks():
    assert build_router_config({"trusted_proxies": ["10.0.0.0/8", "::1"]},
                               env={}).trusted_proxies == ["10.0.0.0/8", "::1"]
    with pytest.raises(ConfigError, match=r"router\.trusted_proxies: not an address or network"):
        build_router_config({"trusted_proxies": ["proxy.local"]}, env={})


async def test_forwarded_headers_are_ignored_unless_their_proxy_is_trusted(
        fake_replicas, monkeypatch):
    # Even with uvicorn's own switch saying "trust everyone", nothing is trusted.
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "*")
    replica = await fake_replicas("r0")
    forwarded = {"x-forwarded-for": "203.0.113.9"}
    async with running_router([replica.url]) as (url, _), httpx.AsyncClient() as client:
        untrusted = await client.get(f"{url}/admin/replicas", headers=forwarded)
    async with (running_router([replica.url], trusted_proxies=["127.0.0.1"]) as (url, _),
                httpx.AsyncClient() as client):
        trusted = await client.get(f"{url}/admin/replicas", headers=forwarded)
    assert untrusted.status_code == 200  # the peer is loopback; the header changed nothing
    assert trusted.status_code == 403  # the trusted proxy says the client is 203.0.113.9
    assert "loopback clients only" in trusted.json()["error"]["message"]


async def test_with_an_admin_port_admin_lives_there_and_nowhere_else(fake_replicas):
    replica = await fake_replicas("r0")
    admin_port = free_port()
    admin = f"http://127.0.0.1:{admin_port}"
    async with (running_router([replica.url], admin_port=admin_port) as (url, _),
                httpx.AsyncClient() as client):
        on_api = await client.get(f"{url}/admin/replicas")
        on_admin = await client.get(f"{admin}/admin/replicas")
        api_on_admin = await client.post(f"{admin}/v1/completions",
                                         json={"model": "fake-model", "prompt": "x"})
        models_on_admin = await client.get(f"{admin}/v1/models")
        probes = [(await client.get(f"{base}/health")).status_code for base in (url, admin)]
        api = await client.post(f"{url}/v1/completions",
                                json={"model": "fake-model", "prompt": "x"})
    assert on_api.status_code == 404
    assert on_admin.status_code == 200
    assert api_on_admin.status_code == models_on_admin.status_code == 404
    assert probes == [200, 200]
    assert api.status_code == 200
    assert replica.reached() == ["POST /v1/completions"]
