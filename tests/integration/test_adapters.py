"""LoRA adapters served by real vLLM replicas (CPU, tiny model) behind the router.

One 2-replica `dpserve serve --enable-lora` for the module (its start overlaps the
real `dpserve finetune --lora-rank` runs that make the adapters); the tests run in
order:

1. refused adapters (another base, a rank above the engines', a full checkpoint
   under `--name`, an adapter without it, the base model's name) change nothing;
2. `dpserve deploy ADAPTER --name support`: `model: support` through the router
   answers, greedily, exactly as transformers + peft runs the adapter, named as the
   client asked, with the version in a header; `/v1/models` lists it;
3. a second version deployed under streaming load: nothing fails, every answer is
   wholly one version's (its tokens equal that version's), the old version is
   unloaded from the engines once its last request ended, a pinned version works
   and a replaced one is a 404;
4. a replica that cannot load a version: rolled back everywhere, the name unchanged;
5. `dpserve deploy ADAPTER --merge`: refused while adapters serve on the base it
   replaces, then with `--drop-adapters` the adapter is folded into full weights and
   hot-loaded, the adapters stop serving, and the base model answers as the adapter did.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from dpserve import checkpoint as ckpt
from dpserve.demo import wait_ready
from tests.finetune_helpers import reference_greedy, trained, write_train_data
from tests.integration.conftest import (
    MODEL_NAME,
    READY_DEADLINE_S,
    Deployment,
    offline_env,
    spawn_deployment,
)
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.vllm

PROMPTS = ["Write about the river (1):", "Tell me about rain."]
NEW_TOKENS = 10


@dataclass
class Fleet:
    d: Deployment
    base: Path
    v1: Path
    v2: Path
    rank16: Path
    work: Path

    def admin(self, path: str) -> dict:
        return httpx.get(self.d.base_url + path, timeout=10).json()

    def engine_models(self) -> list[set[str]]:
        """What each engine itself says it serves (not the router's view)."""
        ports = [port for _, port in self.d.replicas().values()]
        return [{m["id"] for m in httpx.get(f"http://127.0.0.1:{p}/v1/models",
                                            timeout=10).json()["data"]} for p in ports]


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("adapters")
    base = work / "base"  # deploys read checkpoints beside the served model
    shutil.copytree(tiny_model, base)
    d = spawn_deployment(base, work, replicas=2, checkpoint_root=work, serve_args=(
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"))
    try:
        data = write_train_data(work / "train.jsonl")
        lora = {"nproc": 1, "micro_batch_size": 4, "lr": 2e-2}
        v1 = trained(base, data, work / "v1", max_steps=6, lora_rank=8, **lora)
        v2 = trained(base, data, work / "v2", max_steps=12, lora_rank=8, **lora)
        rank16 = trained(base, data, work / "r16", max_steps=1, lora_rank=16, **lora)
        wait_ready(d.base_url, d.proc, READY_DEADLINE_S)
        yield Fleet(d, base, v1, v2, rank16, work)
    finally:
        d.stop()


def deploy(f: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dpserve", "deploy", *args,
                           "--router", f.d.base_url], capture_output=True, text=True,
                          timeout=600, env=offline_env())


def prompt_ids(f: Fleet, prompt: str) -> list[int]:
    r = httpx.post(f.d.base_url + "/tokenize", json={"model": MODEL_NAME, "prompt": prompt},
                   timeout=30)
    return r.json()["tokens"]


def client(f: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f.d.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_refused_adapters_change_nothing(fleet: Fleet) -> None:
    other_base = fleet.work / "other-base"
    ckpt.write_checkpoint(other_base, 6, lambda tmp: [
        shutil.copyfile(p, tmp / p.name) for p in fleet.v1.iterdir()
        if p.name != ckpt.META_FILE],
        base_model=str(fleet.base), loss=1.0, world_size=1,
        extra={**ckpt.read_meta(fleet.v1).extra, "base_fingerprint": "0" * 64})
    cases = [
        ((str(other_base / "step-000006"), "--name", "support"), "fingerprint 000000000000"),
        ((str(fleet.rank16), "--name", "support"), "--max-lora-rank"),
        ((str(fleet.v1), "--name", MODEL_NAME), "the served base model's name"),
        ((str(fleet.v1),), "--name NAME"),  # an adapter where full weights are expected
        ((str(fleet.v1), "--name", "bad/name"), "must be 1-64 letters"),
    ]
    for args, message in cases:
        done = deploy(fleet, *args)
        assert done.returncode == 1, (args, done.stdout, done.stderr)
        assert "deploy refused" in done.stdout and message in done.stdout, (args, done.stdout)
    assert fleet.engine_models() == [{MODEL_NAME}, {MODEL_NAME}]
    listed = client(fleet).models.list()
    assert [m.id for m in listed.data] == [MODEL_NAME]


def test_the_prompts_logprobs_are_refused_and_no_engine_falls(fleet: Fleet) -> None:
    """Three at once through the router: each a 400 that says why. Sent to an engine
    directly, the same three fail it (vLLM issue #16668; measured 2026-11-29: two of
    three answered 500 and the engine process exited)."""
    async def three() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=fleet.d.base_url, timeout=60) as c:
            return list(await asyncio.gather(*(c.post("/v1/completions", json={
                "model": MODEL_NAME, "prompt": "Spell 458." + " x" * i, "max_tokens": 1,
                "prompt_logprobs": 0}) for i in range(3))))
    answers = asyncio.run(three())
    assert [a.status_code for a in answers] == [400] * 3, [a.text for a in answers]
    assert answers[0].json()["error"]["param"] == "prompt_logprobs"
    ready = httpx.get(fleet.d.base_url + "/ready", timeout=10).json()
    assert ready["replicas_ready"] == 2
    plain = client(fleet).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert plain.choices[0].finish_reason in ("length", "stop")


def test_an_adapter_answers_as_peft_runs_it_under_the_name_the_client_used(fleet: Fleet):
    done = deploy(fleet, str(fleet.v1), "--name", "support")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "adapter support version step-000006@" in done.stdout
    version = fleet.admin("/admin/deploy")["version"]
    c = client(fleet)
    for prompt in PROMPTS:
        ids = prompt_ids(fleet, prompt)
        raw = c.completions.with_raw_response.create(
            model="support", prompt=ids, max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"return_token_ids": True})
        answer = raw.parse()
        assert raw.headers["x-dpserve-weight-version"] == version
        assert answer.model == "support"
        assert answer.choices[0].token_ids == reference_greedy(
            fleet.base, ids, NEW_TOKENS, adapter=fleet.v1), prompt
    base_ids = prompt_ids(fleet, PROMPTS[0])
    plain = c.completions.create(model=MODEL_NAME, prompt=base_ids, max_tokens=NEW_TOKENS,
                                 temperature=0, extra_body={"return_token_ids": True})
    assert plain.choices[0].token_ids == reference_greedy(fleet.base, base_ids, NEW_TOKENS)
    listed = {m.id: m for m in c.models.list().data}
    assert set(listed) == {MODEL_NAME, "support", f"support@{version}"}
    assert listed["support"].model_extra["parent"] == MODEL_NAME
    assert fleet.engine_models() == [{MODEL_NAME, f"support@{version}"}] * 2
    status = subprocess.run([sys.executable, "-m", "dpserve", "status", "--router",
                             fleet.d.base_url], capture_output=True, text=True, timeout=60)
    table = status.stdout.splitlines()
    assert "adapters" in table[0].split()
    assert all(f"support@{version}" in row for row in table[1:3]), status.stdout
    metrics = httpx.get(fleet.d.base_url + "/metrics", timeout=10).text
    assert 'dpserve_adapter_requests_total{adapter="support"} 2.0' in metrics
    assert 'dpserve_deploys_total{outcome="succeeded"} 1.0' in metrics


def test_a_new_version_replaces_the_old_under_load_and_each_answer_is_one_versions(fleet):
    v1 = fleet.admin("/admin/deploy")["version"]
    ids = prompt_ids(fleet, PROMPTS[1])
    expected = {repr(reference_greedy(fleet.base, ids, NEW_TOKENS, adapter=a)): a.name
                for a in (fleet.v1, fleet.v2)}
    assert len(expected) == 2, "the two versions must answer differently to tell them apart"
    answers: list[tuple[str, list[int]]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def stream_until_stopped() -> None:
        c = client(fleet)
        try:
            while not stop.is_set() and len(answers) < 400:
                tokens: list[int] = []
                models = set()
                with c.completions.with_streaming_response.create(
                        model="support", prompt=ids, max_tokens=NEW_TOKENS, temperature=0,
                        stream=True, extra_body={"return_token_ids": True}) as raw:
                    header = raw.headers["x-dpserve-weight-version"]
                    for chunk in raw.parse():
                        models.add(chunk.model)
                        if chunk.choices:
                            tokens += chunk.choices[0].token_ids or []
                assert models == {"support"}
                answers.append((header, tokens))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=stream_until_stopped) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        wait_for_sync(lambda: len(answers) >= 3, "streams on v1", within_s=60)
        done = deploy(fleet, str(fleet.v2), "--name", "support")
        assert done.returncode == 0, done.stdout + done.stderr
        v2 = fleet.admin("/admin/deploy")["version"]
        seen = len(answers)
        wait_for_sync(lambda: len(answers) >= seen + 3, "streams on v2", within_s=60)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not errors, errors
    by_version = {v1: fleet.v1.name, v2: fleet.v2.name}
    for header, tokens in answers:  # wholly one version: its header and its tokens
        assert expected[repr(tokens)] == by_version[header]
    assert {h for h, _ in answers} == {v1, v2}
    wait_for_sync(lambda: fleet.engine_models() == [{MODEL_NAME, f"support@{v2}"}] * 2,
                  "the old version unloaded", within_s=30)
    c = client(fleet)
    pinned = c.completions.create(model=f"support@{v2}", prompt=ids, max_tokens=NEW_TOKENS,
                                  temperature=0, extra_body={"return_token_ids": True})
    assert pinned.model == f"support@{v2}"
    with pytest.raises(openai.NotFoundError) as gone:
        c.completions.create(model=f"support@{v1}", prompt=ids, max_tokens=2)
    assert f"serves version {v2}" in str(gone.value)


def test_a_replica_that_cannot_load_a_version_rolls_it_back_everywhere(fleet: Fleet):
    before = fleet.admin("/admin/deploy")["version"]
    # A third version, its engine name already taken on r1 (loaded there by hand): that
    # engine refuses to load it again, as an engine that cannot read it would.
    v3 = trained(fleet.base, write_train_data(fleet.work / "train3.jsonl", n=32),
                 fleet.work / "v3", nproc=1, micro_batch_size=4, lr=2e-2, max_steps=3,
                 lora_rank=8)
    from dpserve.rollout.deployed import checkpoint_version

    name = f"support@{checkpoint_version(ckpt.read_meta(v3))}"
    _, r1_port = fleet.d.replicas()["r1"]
    r = httpx.post(f"http://127.0.0.1:{r1_port}/v1/load_lora_adapter",
                   json={"lora_name": name, "lora_path": str(v3)}, timeout=120)
    assert r.status_code == 200, r.text
    done = deploy(fleet, str(v3), "--name", "support")
    assert done.returncode == 1 and "rolled_back" in done.stdout, done.stdout
    assert "has already been loaded" in done.stdout
    record = fleet.admin("/admin/deploy")
    assert record["state"] == "rolled_back"
    models = fleet.engine_models()
    assert name not in models[0]  # unloaded from the replica that had loaded it
    answer = client(fleet).completions.with_raw_response.create(
        model="support", prompt="x", max_tokens=2)
    assert answer.headers["x-dpserve-weight-version"] == before


def test_replicas_without_enable_lora_refuse_an_adapter_saying_how(deployment, fleet):
    r = httpx.post(deployment.base_url + "/admin/deploy", timeout=60,
                   json={"checkpoint": str(fleet.v1), "name": "support"})
    assert r.status_code == 409
    assert "--enable-lora" in r.json()["error"]["message"]


def test_merge_folds_the_adapter_into_full_weights_and_hot_loads_them(fleet: Fleet):
    # `support` serves on the base it was trained on: replacing that base is refused
    # unless the deploy also stops serving the adapters.
    refused = deploy(fleet, str(fleet.v1), "--merge")
    assert refused.returncode == 1 and "--drop-adapters" in refused.stdout, refused.stdout
    assert "support" in {m.id for m in client(fleet).models.list().data}
    listed = {m.id: m for m in client(fleet).models.list().data}
    served = f"support@{listed['support'].model_extra['dpserve']['version']}"
    done = deploy(fleet, str(fleet.v1), "--merge", "--drop-adapters")
    assert done.returncode == 0, done.stdout + done.stderr
    # r1 still holds the version loaded there by hand above: not the router's, not listed.
    assert [m.id for m in client(fleet).models.list().data] == [MODEL_NAME]
    wait_for_sync(lambda: all(served not in m for m in fleet.engine_models()),
                  "the dropped adapter unloaded from the engines", within_s=60)
    gone = httpx.post(fleet.d.base_url + "/v1/completions", timeout=30,
                      json={"model": "support", "prompt": "x", "max_tokens": 2})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
    assert f"merged checkpoint {fleet.v1.parent / 'merged' / fleet.v1.name}" in done.stdout
    ids = prompt_ids(fleet, PROMPTS[0])
    answer = client(fleet).completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"return_token_ids": True})
    assert answer.choices[0].token_ids == reference_greedy(fleet.base, ids, NEW_TOKENS,
                                                           adapter=fleet.v1)
    meta = json.loads((fleet.v1.parent / "merged" / fleet.v1.name / ckpt.META_FILE).read_text())
    assert meta["extra"]["kind"] == "full"
