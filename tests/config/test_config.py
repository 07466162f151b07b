from __future__ import annotations

import pytest

from dpserve.config import (
    ConfigError,
    RouterConfig,
    build_router_config,
    build_serve_config,
    effective_policy,
    load_yaml,
)
from dpserve.config.fielddocs import field_docs
from dpserve.config.keys import MIN_ADMIN_KEY_CHARS, MIN_API_KEY_CHARS


def test_flags_beat_env_beat_file_beat_defaults():
    file = {"model": "from-file", "replicas": 3, "router": {"port": 7000, "policy": "round-robin"}}
    env = {"DPSERVE_REPLICAS": "4", "DPSERVE_PORT": "7100"}
    cfg = build_serve_config({"port": 7200}, file, env)
    assert cfg.model == "from-file"       # file
    assert cfg.replicas == 4              # env over file
    assert cfg.router.port == 7200        # flag over env and file
    assert cfg.router.policy == "round-robin"
    assert cfg.router.host == "127.0.0.1"  # default


def test_env_values_are_parsed_to_the_declared_types():
    env = {"DPSERVE_GPUS": "0, 2", "DPSERVE_CPU_KVCACHE_GIB": "1.5",
           "DPSERVE_HEALTH_INTERVAL_S": "0.5"}
    cfg = build_serve_config({"model": "m"}, {}, env)
    assert cfg.gpus == [0, 2]
    assert cfg.cpu_kvcache_gib == 1.5
    assert cfg.router.health_interval_s == 0.5


@pytest.mark.parametrize(("flags", "env", "message"), [
    ({}, {}, "missing required setting(s): model"),
    ({"model": "m", "port": 70000}, {}, "router.port: must be in 0..65535, got 70000"),
    ({"model": "m", "policy": "fastest"}, {}, "router.policy: must be one of"),
    ({"model": "m", "replicas": 0}, {}, "replicas: must be >= 1, got 0"),
    ({"model": "m"}, {"DPSERVE_REPLICAS": "two"}, "replicas: expected an integer, got 'two'"),
    ({"model": "m", "gpus": [0, 0]}, {}, "gpus: must not repeat a GPU"),
    ({"model": "m", "gpus": [0, 1], "replicas": 3}, {}, "replicas: must equal the number"),
    ({"model": "m", "cpu_binds": "0-3|x"}, {}, "cpu_binds: must be core lists"),
    ({"model": "m", "vllm_args": ["--port", "9"]}, {}, "vllm_args: must not set --host"),
    ({"model": "m", "max_attempts": 0}, {}, "router.max_attempts: must be >= 1"),
    ({"model": "m", "restart_backoff_s": 5, "restart_backoff_max_s": 1}, {},
     "restart_backoff_max_s: must be >= restart_backoff_s"),
    ({"model": "m", "enable_lora": True, "max_lora_rank": 12}, {},
     "router.max_lora_rank: must be one of 1, 8, 16"),
    ({"model": "m", "enable_lora": True, "max_loras": 0}, {}, "router.max_loras: must be >= 1"),
    ({"model": "m", "enable_lora": True, "max_loras": 4, "max_cpu_loras": 2}, {},
     "router.max_cpu_loras: must be >= max_loras (4)"),
    ({"model": "m", "loras": ["support=/ckpt/a"]}, {},
     "router.enable_lora: must be set to deploy adapters (--enable-lora)"),
    ({"model": "m", "enable_lora": True, "loras": ["/ckpt/a"]}, {},
     "router.loras: expected NAME=DIR, got '/ckpt/a'"),
    ({"model": "m", "enable_lora": True, "loras": ["a@1=/ckpt/a"]}, {},
     "router.loras: adapter name 'a@1' must be"),
    ({"model": "m", "enable_lora": True, "loras": ["a=/x", "a=/y"]}, {},
     "router.loras: must not name an adapter twice"),
    ({"model": "m", "vllm_args": ["--max-lora-rank=64"]}, {},
     "use --enable-lora, --max-loras, --max-lora-rank"),
    ({"model": "m"}, {"DPSERVE_KV_EVENTS_ENDPOINT": "tcp://10.0.0.1:5557"},
     "router.kv_events_endpoint: must be tcp://*:PORT"),
    ({"model": "m"}, {"DPSERVE_KV_EVENTS_ENDPOINT": "tcp://*:70000"},
     "router.kv_events_endpoint: must be tcp://*:PORT"),
    ({"model": "m"}, {"DPSERVE_KV_EVENTS_REPLAY_ENDPOINT": "tcp://*:5558"},
     "router.kv_events_replay_endpoint: needs kv_events_endpoint"),
])
def test_invalid_settings_are_refused_naming_the_setting(flags, env, message):
    with pytest.raises(ConfigError) as exc:
        build_serve_config(flags, {}, env)
    assert message in str(exc.value)


def test_unknown_keys_in_the_file_are_refused():
    with pytest.raises(ConfigError, match=r"unknown setting.*router\.prot"):
        build_serve_config({"model": "m"}, {"router": {"prot": 1}}, {})
    with pytest.raises(ConfigError, match=r"unknown setting.*replica\b"):
        build_serve_config({"model": "m"}, {"replica": 1}, {})


def test_file_values_must_have_the_right_type():
    with pytest.raises(ConfigError, match=r"router\.port: expected an integer, got 'eighty'"):
        build_router_config({}, {"port": "eighty"}, {})
    with pytest.raises(ConfigError, match="gpus: expected a list of an integer"):
        build_serve_config({"model": "m"}, {"gpus": ["a"]}, {})


def test_yaml_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_yaml(bad)
    good = tmp_path / "good.yaml"
    good.write_text("model: m\nrouter:\n  port: 9000\n")
    assert build_serve_config({}, load_yaml(good), {}).router.port == 9000


def test_a_bad_key_is_refused_naming_where_it_came_from_never_showing_it(tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text("# rotated monthly\nfirst-key-0123\n\nabc\n")
    with pytest.raises(ConfigError) as exc:
        build_router_config({"api_key_file": str(keys)}, {}, {})
    assert str(exc.value) == ("router.api_key: must be at least 8 characters (the key from "
                              f"line 4 of {keys}), got '<hidden>'")
    with pytest.raises(ConfigError, match=r"\(the key from DPSERVE_API_KEYS\)"):
        build_router_config({}, {}, {"DPSERVE_API_KEYS": "first-key-0123,has space"})
    with pytest.raises(ConfigError, match=r"at least 16 characters \(the key from "
                                          r"DPSERVE_ADMIN_KEY\)"):
        build_router_config({}, {}, {"DPSERVE_ADMIN_KEY": "admin-short"})
    with pytest.raises(ConfigError, match=r"\(the key from router.api_key in the file\)"):
        build_router_config({}, {"api_key": "tiny"}, {})


def test_the_key_minimums_are_stated_where_keys_are_documented():
    docs = field_docs(RouterConfig)
    for name in ("api_key", "api_keys", "api_key_file"):
        assert f"at least {MIN_API_KEY_CHARS} " in docs[name], name
    for name in ("admin_key", "admin_key_file"):
        assert f"at least {MIN_ADMIN_KEY_CHARS} " in docs[name], name


def test_a_model_path_from_the_file_has_its_tilde_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert build_serve_config({}, {"model": "~/models/m"}, {}).model == str(
        tmp_path / "models" / "m")


def test_auto_routes_on_kv_events_where_prompts_can_be_tokenized():
    serve = build_serve_config({"model": "/models/m"}, env={})
    assert serve.router.policy == "auto" and serve.router.tokenizer == "/models/m"
    assert effective_policy(serve.router) == "kv-aware"
    assert effective_policy(build_router_config({}, env={})) == "prefix-affinity"
    assert effective_policy(build_router_config({"tokenizer": "/t"}, env={})) == "kv-aware"
    chosen = build_serve_config({"model": "/models/m", "policy": "round-robin"}, env={})
    assert effective_policy(chosen.router) == "round-robin"
    assert chosen.router.tokenizer is None  # nothing is tokenized for a policy that does not


def test_kv_aware_runs_with_several_workers():
    config = build_serve_config({"model": "m", "policy": "kv-aware", "workers": 2}, env={})
    assert (config.router.workers, config.router.tokenizer) == (2, "m")
