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
    keyed = {"DPSERVE_ADMIN_KEY": ADMIN_KEY}
    assert build_router_config({"trusted_proxies": ["10.0.0.0/8", "::1"]},
                               env=keyed).trusted_proxies == ["10.0.0.0/8", "::1"]
    with pytest.raises(ConfigError, match=r"router\.trusted_proxies: not an address or network"):
        build_router_config({"trusted_proxies": ["proxy.local"]}, env=keyed)


@pytest.mark.parametrize("flags", [
    {"trusted_proxies": ["127.0.0.6"]},
    {"trusted_proxies": ["10.0.0.0/8"], "insecure_admin": True},
    {"trusted_proxies": ["127.0.0.6"], "admin_port": 9001},
])
def test_trusted_proxies_need_an_admin_key(flags):
    """A proxy relays remote clients; one on this machine (Istio's sidecar) relays them
    from a loopback address. Without a key, /admin would answer them."""
    with pytest.raises(ConfigError, match=r"router\.admin_key: required with "
                                          r"router\.trusted_proxies"):
        build_router_config(flags, env={})
    build_router_config(flags, env={"DPSERVE_ADMIN_KEY": ADMIN_KEY})


def test_local_admin_addresses_are_loopback_only():
    assert build_router_config({}, env={}).local_admin_addresses == ["127.0.0.1", "::1"]
    wider = build_router_config({}, env={"DPSERVE_LOCAL_ADMIN_ADDRESSES": "127.0.0.0/8,::1"})
    assert wider.local_admin_addresses == ["127.0.0.0/8", "::1"]
    for bad, why in (("10.0.0.1", "must be loopback"), ("0.0.0.0/0", "must be loopback"),
                     ("sidecar", "not an address")):
        with pytest.raises(ConfigError, match=f"router.local_admin_addresses: {why}"):
            build_router_config({"local_admin_addresses": [bad]}, env={})


async def get_from(source: str, url: str) -> int:
    """GET `url` on a connection from the local address `source` (all of 127.0.0.0/8
    is this machine's, as a sidecar's 127.0.0.6 is)."""
    transport = httpx.AsyncHTTPTransport(local_address=source)
    async with httpx.AsyncClient(transport=transport) as client:
        return (await client.get(url)).status_code


async def test_a_client_relayed_from_another_loopback_address_is_not_local(fake_replicas):
    replica = await fake_replicas("r0")
    async with running_router([replica.url]) as (url, _):
        sidecar = await get_from("127.0.0.6", f"{url}/admin/replicas")
        here = await get_from("127.0.0.1", f"{url}/admin/replicas")
        api = await get_from("127.0.0.6", f"{url}/v1/models")
    assert (sidecar, here, api) == (403, 200, 200)
    async with running_router([replica.url],
                              local_admin_addresses=["127.0.0.0/8"]) as (url, _):
        assert await get_from("127.0.0.6", f"{url}/admin/replicas") == 200  # said so


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
    assert "local clients only" in trusted.json()["error"]["message"]


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
