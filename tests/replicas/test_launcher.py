from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from dpserve.config import ConfigError, RouterConfig, ServeConfig
from dpserve.replicas.launcher import (
    engine_environment,
    plan_replicas,
    split_cores,
    visible_gpus,
)


def closed_port_url() -> str:
    """A loopback URL nobody listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _plan(cfg: ServeConfig, gpus=(), cores=(0, 1)):
    return plan_replicas(cfg, gpus=list(gpus), cores=list(cores), port=lambda i: 9000 + i,
                         run_dir=Path("/tmp/run"), python="py")


def test_cpu_replicas_get_their_own_cores_and_a_bounded_kv_cache():
    specs = _plan(ServeConfig(model="m", cpu_kvcache_gib=2), cores=[0, 1, 2, 3])
    assert [s.device for s in specs] == ["cpu:0,1", "cpu:2,3"]
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in specs] == ["0,1", "2,3"]
    assert all(s.env["VLLM_CPU_KVCACHE_SPACE"] == "2" for s in specs)


def test_every_replica_listens_on_loopback_with_dev_mode_for_hot_loading():
    for spec in _plan(ServeConfig(model="m", vllm_args=["--enforce-eager"])):
        argv = list(spec.argv)
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert argv[argv.index("--port") + 1] == str(spec.port)
        assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        assert argv[-1] == "--enforce-eager"
        assert spec.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert [s.url for s in _plan(ServeConfig(model="m"))] == [
        "http://127.0.0.1:9000", "http://127.0.0.1:9001"]


def test_lora_serving_starts_every_replica_able_to_load_adapters_at_run_time():
    router = RouterConfig(enable_lora=True, max_loras=2, max_lora_rank=32, max_cpu_loras=4)
    for spec in _plan(ServeConfig(model="m", router=router)):
        argv = list(spec.argv)
        assert "--enable-lora" in argv
        assert [argv[argv.index(f) + 1] for f in
                ("--max-loras", "--max-lora-rank", "--max-cpu-loras")] == ["2", "32", "4"]
        assert spec.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    for spec in _plan(ServeConfig(model="m")):  # without it, no adapter can be loaded
        assert "--enable-lora" not in spec.argv
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in spec.env


def test_one_replica_per_visible_gpu_each_seeing_only_its_own():
    specs = _plan(ServeConfig(model="m"), gpus=[0, 1, 2])
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "1", "2"]
    assert [s.device for s in specs] == ["gpu:0", "gpu:1", "gpu:2"]
    assert all("VLLM_CPU_OMP_THREADS_BIND" not in s.env for s in specs)


def test_named_gpus_and_replica_count_are_honoured():
    assert [s.device for s in _plan(ServeConfig(model="m", gpus=[3, 5]), gpus=[0])] == [
        "gpu:3", "gpu:5"]
    assert len(_plan(ServeConfig(model="m", replicas=2), gpus=[0, 1, 2, 3])) == 2
    with pytest.raises(ConfigError, match="replicas: 4 replicas need as many GPUs"):
        _plan(ServeConfig(model="m", replicas=4), gpus=[0, 1])


def test_explicit_cpu_binds_override_the_split():
    specs = _plan(ServeConfig(model="m", replicas=2, cpu_binds="0-3|4-7"))
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in specs] == ["0-3", "4-7"]
    assert [s.cores for s in specs] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_a_cpu_replica_runs_its_model_in_the_engine_process_on_its_own_cores():
    r0, r1 = _plan(ServeConfig(model="m", replicas=2, cpu_binds="0,2-3|1"))
    assert r0.cores == (0, 2, 3) and r1.cores == (1,)
    assert r0.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # no worker process of its own
    assert (r0.env["OMP_NUM_THREADS"], r0.env["OMP_PLACES"], r0.env["OMP_PROC_BIND"]) == (
        "3", "{0,2,3}", "true")
    assert (r1.env["OMP_NUM_THREADS"], r1.env["OMP_PLACES"]) == ("1", "{1}")
    # Tensor parallel needs vLLM's worker processes: they keep theirs, bound by vLLM.
    for args in (["--tensor-parallel-size", "2"], ["-tp=2"],
                 ["--distributed-executor-backend", "mp"]):
        spec = _plan(ServeConfig(model="m", replicas=1, cpu_binds="0-3", vllm_args=args))[0]
        assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
        assert not {"VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS"} & spec.env.keys()
    assert all(s.cores == () for s in _plan(ServeConfig(model="m"), gpus=[0, 1]))


def test_served_model_name_defaults_to_the_model_argument():
    argv = list(_plan(ServeConfig(model="org/model"))[0].argv)
    assert argv[argv.index("--served-model-name") + 1] == "org/model"


def test_split_cores_shares_cores_when_there_are_more_replicas_than_cores():
    assert split_cores([0, 1], 2) == ["0", "1"]
    assert split_cores([0, 1, 2, 3, 4], 2) == ["0,1", "2,3"]
    assert split_cores([0, 1], 3) == ["0", "1", "0"]


def test_visible_gpus_follow_cuda_visible_devices():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == [2, 3]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_with_a_kv_directory_each_engine_publishes_its_events_on_its_own_unix_sockets():
    specs = plan_replicas(ServeConfig(model="m"), gpus=[], cores=[0, 1],
                          port=lambda i: 9000 + i, run_dir=Path("/tmp/run"), python="py",
                          kv_dir=Path("/tmp/dpserve-kv-x"))
    configs = []
    for spec in specs:
        argv = list(spec.argv)
        configs.append(json.loads(argv[argv.index("--kv-events-config") + 1]))
    assert [(c["endpoint"], c["replay_endpoint"]) for c in configs] == [
        ("ipc:///tmp/dpserve-kv-x/r0.pub", "ipc:///tmp/dpserve-kv-x/r0.replay"),
        ("ipc:///tmp/dpserve-kv-x/r1.pub", "ipc:///tmp/dpserve-kv-x/r1.replay")]
    assert all(c["enable_kv_cache_events"] and c["publisher"] == "zmq" for c in configs)


def test_without_a_kv_directory_or_with_the_users_own_config_none_is_added():
    assert all("--kv-events-config" not in s.argv for s in _plan(ServeConfig(model="m")))
    own = ["--kv-events-config", '{"enable_kv_cache_events": false}']
    specs = plan_replicas(ServeConfig(model="m", vllm_args=own), gpus=[], cores=[0, 1],
                          port=lambda i: 9000 + i, run_dir=Path("/tmp/run"), python="py",
                          kv_dir=Path("/tmp/k"))
    assert all(list(s.argv).count("--kv-events-config") == 1 for s in specs)


def test_vllm_settings_reach_the_engines_and_dpserve_keys_do_not():
    """`VLLM_BATCH_INVARIANT=1` in dpserve's environment turns on vLLM's batch-invariant
    mode in every engine (docs/serving.md, exactness of a migrated stream); the keys of
    dpserve's own settings stay out of the engines' environment."""
    env = engine_environment({"VLLM_BATCH_INVARIANT": "1", "DPSERVE_API_KEY": "sk-secret",
                              "DPSERVE_ASSEMBLE_RESPONSES": "false", "PATH": "/bin"},
                             {"CUDA_VISIBLE_DEVICES": "0"})
    assert env == {"VLLM_BATCH_INVARIANT": "1", "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0"}
