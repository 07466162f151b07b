"""What `dpserve serve` and `dpserve router` refuse before starting anything, and what
they only say: each finding is one line that starts with the flag it is about."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpserve.config import ServeConfig
from dpserve.preflight import (
    check_cores,
    check_gpus,
    check_model,
    check_router,
    check_serve,
    hub_cache,
)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "build" / "tiny-llama"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return model


def model(name: str, env: dict[str, str] | None = None, vllm_args: tuple[str, ...] = ()):
    return check_model(name, flag="--model", environ=env or {}, vllm_args=vllm_args)


def test_a_model_directory_with_its_config_passes_without_a_word(model_dir):
    found = model(str(model_dir))
    assert found.problems == [] and found.notes == []


def test_a_missing_local_path_is_refused_naming_the_flag():
    assert model("/no/such/dir").problems == ["--model /no/such/dir: no such directory"]
    assert model("./nowhere").problems == ["--model ./nowhere: no such directory"]


def test_a_typo_under_an_existing_folder_is_a_local_path_with_a_suggestion(
        model_dir, monkeypatch):
    monkeypatch.chdir(model_dir.parents[1])
    (problem,) = model("build/tiny-lama").problems  # also looks like ORG/NAME
    assert problem == ("--model build/tiny-lama: no such directory; did you mean "
                       "build/tiny-llama?")


def test_a_directory_without_config_json_is_not_a_model(tmp_path):
    assert model(str(tmp_path)).problems == [
        f"--model {tmp_path}: no config.json in it (not a Hugging Face model directory)"]


def test_a_file_is_refused_unless_it_is_a_gguf_model(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "model.gguf").write_bytes(b"")
    assert model(str(tmp_path / "model.safetensors")).problems == [
        f"--model {tmp_path / 'model.safetensors'}: is a file; give the model's directory"]
    assert model(str(tmp_path / "model.gguf")).problems == []


def test_a_hub_id_is_noted_as_fetched_by_vllm(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    found = model("Qwen/Qwen3-0.6B")
    assert found.problems == []
    assert found.notes == ["--model Qwen/Qwen3-0.6B: not a local directory; vLLM will "
                           "fetch it from the Hugging Face hub (or its cache)"]


def test_offline_a_hub_id_must_be_in_the_local_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "hub"
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    (problem,) = model("Qwen/Qwen3-0.6B", env).problems
    assert problem == ("--model Qwen/Qwen3-0.6B: not a local directory, and HF_HUB_OFFLINE "
                       f"is set but it is not in the local Hugging Face cache ({cache})")
    snapshot = cache / "models--Qwen--Qwen3-0.6B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    found = model("Qwen/Qwen3-0.6B", env)
    assert found.problems == [] and "loads it from the local cache" in found.notes[0]


def test_the_hub_cache_is_vllms_download_dir_else_hugging_faces():
    assert hub_cache({}, ["--download-dir", "/models"]) == Path("/models")
    assert hub_cache({}, ["--download-dir=/models"]) == Path("/models")
    assert hub_cache({"HF_HUB_CACHE": "/c"}) == Path("/c")
    assert hub_cache({"HF_HOME": "/h"}) == Path("/h/hub")
    assert hub_cache({"XDG_CACHE_HOME": "/x"}) == Path("/x/huggingface/hub")


def test_neither_a_path_nor_a_hub_id_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert model("my model").problems == [
        "--model my model: no such directory, and not a Hugging Face id (NAME or ORG/NAME)"]


def test_a_url_is_left_to_vllm():
    found = model("s3://bucket/model")
    assert found.problems == [] and found.notes == []


def test_a_routers_base_model_must_be_a_local_directory(model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert check_router(None).problems == []
    assert check_router(str(model_dir)).problems == []
    assert check_router("org/name").problems == ["--base-model org/name: no such directory"]


def test_gpus_must_be_visible():
    assert check_gpus(None, [], {}).problems == []
    assert check_gpus([0, 1], [0, 1, 2], {}).problems == []
    assert check_gpus([1, 3], [0, 1], {}).problems == [
        "--gpus 1,3: no GPU 3 here (visible: 0,1)"]


def test_gpus_on_a_machine_without_any_point_to_cpu_replicas():
    (problem,) = check_gpus([0], [], {"CUDA_VISIBLE_DEVICES": ""}).problems
    assert problem == ("--gpus 0: no GPU is visible here (CUDA_VISIBLE_DEVICES is empty); "
                       "leave --gpus out to serve on CPU replicas")
    (problem,) = check_gpus([0], [], {}).problems
    assert "(nvidia-smi finds none)" in problem


def test_gpus_named_by_uuid_are_left_to_cuda():
    env = {"CUDA_VISIBLE_DEVICES": "GPU-8f2c0d4e-1111-2222-3333-444455556666"}
    assert check_gpus([0], [], env).problems == []


def test_cpu_binds_must_name_usable_cores():
    cfg = ServeConfig(model="m", cpu_binds="0-1|2-7")
    assert check_cores(cfg, [0, 1, 2, 3]).problems == [
        "--cpu-binds 0-1|2-7: core(s) 4,5,6,7 not usable by this process (usable: 0-3)"]
    assert check_cores(ServeConfig(model="m", cpu_binds="0|1"), [0, 1]).problems == []


def test_more_cpu_replicas_than_cores_is_noted_not_refused():
    found = check_cores(ServeConfig(model="m", replicas=3), [0, 1])
    assert found.problems == []
    assert found.notes == ["--replicas 3: only 2 usable core(s); the CPU replicas share "
                           "them and each runs slower"]


def test_serve_reports_every_problem_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = ServeConfig(model="/no/such/dir", gpus=[2])
    found = check_serve(cfg, visible=[0], cores=[0, 1], environ={})
    assert found.problems == ["--model /no/such/dir: no such directory",
                              "--gpus 2: no GPU 2 here (visible: 0)"]


def test_cores_are_not_checked_when_replicas_run_on_gpus(model_dir):
    cfg = ServeConfig(model=str(model_dir), cpu_binds="0-63")
    assert check_serve(cfg, visible=[0], cores=[0], environ={}).problems == []
    assert check_serve(cfg, visible=[], cores=[0], environ={}).problems != []
