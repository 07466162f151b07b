"""A deploy's quality gate (`--eval`, `rollout.quality`) against FakeReplicas that answer
an eval set as scripted per weights (tests/fakes.py `skill`); scoring on a real engine
is in tests/integration/test_deploy.py."""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

import httpx
import pytest

from dpserve.rollout.client import AdminClient, run_deploy, run_status
from dpserve.rollout.deployed import weights_for
from tests.rollout.checkpoints import perturbed, write_variant
from tests.rollout.fleet import deploy, fleet

QUESTIONS = {f"{i}+{i}=": str(2 * i) for i in range(2, 22)}
"""20 examples: enough for a paired comparison to be sure of a difference of one half."""
ALL_RIGHT = (dict(QUESTIONS), -0.1)
HALF_RIGHT = (dict(list(QUESTIONS.items())[:10]), -0.5)
NONE_RIGHT = ({}, -3.0)


@pytest.fixture(scope="module")
def checkpoint(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_variant(tiny_model, tmp_path_factory.mktemp("ckpts"), 1,
                         tensors=perturbed(0.01, seed=1))


@pytest.fixture
def eval_file():
    """Inside the fleet's checkpoint root (the temp directory)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "eval.jsonl"
        path.write_text("".join(json.dumps({"prompt": q, "completion": a}) + "\n"
                                for q, a in QUESTIONS.items()))
        yield path


async def gated(fake_replicas, tiny_model, checkpoint, *, base, new, replicas=2, **options):
    async with fleet(fake_replicas, tiny_model, replicas) as f:
        for fake in f.fakes:
            fake.skill = {None: base, "step-000001": new}
        status, record = await deploy(f, checkpoint, **options)
        return status, record, f.versions()


async def test_a_version_below_the_minimum_score_is_rolled_back_with_its_scores(
        fake_replicas, tiny_model, checkpoint, eval_file):
    status, record, versions = await gated(
        fake_replicas, tiny_model, checkpoint, base=ALL_RIGHT, new=NONE_RIGHT,
        eval_data=str(eval_file), gate_min_score=0.5)
    assert status == 202 and record["state"] == "rolled_back", record
    quality = record["quality"]
    assert quality["candidate"] == {"exact_match": 0.0, "mean_logprob": -3.0, "examples": 20}
    assert quality["passed"] is False and "below the minimum 0.5" in quality["reason"]
    assert "quality gate: exact_match 0 over 20 examples" in record["error"]
    assert versions == [weights_for(str(tiny_model)).version] * 2
    assert record["replicas"][1]["phase"] == "pending"  # the others were never touched


@pytest.mark.parametrize(("margin", "state"), [(0.0, "rolled_back"), (0.5, "succeeded")])
async def test_against_the_current_version_the_margin_decides(
        fake_replicas, tiny_model, checkpoint, eval_file, margin, state):
    _, record, versions = await gated(
        fake_replicas, tiny_model, checkpoint, base=ALL_RIGHT, new=HALF_RIGHT,
        eval_data=str(eval_file), gate_vs_current=True, gate_margin=margin)
    assert record["state"] == state, record
    assert record["quality"]["current"]["exact_match"] == 1.0
    assert record["quality"]["candidate"]["exact_match"] == 0.5
    assert record["quality"]["passed"] is (state == "succeeded")
    comparison = record["quality"]["comparison"]
    assert comparison["difference"] == -0.5 and comparison["high"] < -0.25
    assert comparison["spread"] == 0 and comparison["repeats"] == 2
    assert comparison["examples"] == 20 and comparison["sure"] is (margin == 0.0)
    want = weights_for(str(checkpoint if state == "succeeded" else tiny_model)).version
    assert versions == [want, want]


async def test_free_text_is_gated_on_its_log_likelihood(fake_replicas, tiny_model, checkpoint,
                                                        eval_file):
    _, record, _ = await gated(
        fake_replicas, tiny_model, checkpoint, base=({}, -0.5), new=({}, -2.0),
        eval_data=str(eval_file), gate_vs_current=True, gate_metric="mean_logprob",
        gate_margin=1.0)
    assert record["state"] == "rolled_back"
    assert record["quality"]["reason"] == (
        "quality gate: mean_logprob -2 over 20 examples, -1.5 per example (95% interval "
        "-1.5..-1.5 over 20 examples; runs of one version differed by up to 0 over 2 runs "
        "each) against the current version: surely more than the margin 1 below it")


async def test_the_same_checkpoint_against_itself_passes(fake_replicas, tiny_model,
                                                         checkpoint, eval_file):
    _, record, _ = await gated(fake_replicas, tiny_model, checkpoint, base=HALF_RIGHT,
                               new=HALF_RIGHT, eval_data=str(eval_file),
                               gate_vs_current=True, gate_repeats=3)
    assert record["state"] == "succeeded", record
    assert record["quality"]["comparison"]["difference"] == 0
    assert record["quality"]["comparison"]["repeats"] == 3


async def test_an_eval_set_alone_scores_the_new_version_and_gates_nothing(
        fake_replicas, tiny_model, checkpoint, eval_file):
    _, record, _ = await gated(fake_replicas, tiny_model, checkpoint, base=ALL_RIGHT,
                               new=NONE_RIGHT, eval_data=str(eval_file))
    assert record["state"] == "succeeded"
    assert record["quality"]["candidate"]["exact_match"] == 0.0
    assert "passed" not in record["quality"] and "current" not in record["quality"]


@pytest.mark.parametrize(("options", "status", "param", "message"), [
    ({"gate_min_score": 0.5}, 400, "eval_data", "needs an eval set"),
    ({"eval_data": "relative.jsonl"}, 400, "eval_data", "absolute path"),
    ({"eval_data": "/etc/hostname"}, 403, "eval_data", "not inside the checkpoint root"),
    ({"eval_data": "{bad}"}, 422, "eval_data", "bad.jsonl:2: not valid JSON"),
    ({"eval_data": "{eval}", "gate_metric": "bleu"}, 400, "gate_metric", "one of"),
    ({"eval_data": "{eval}", "gate_margin": -1}, 400, "gate_margin", "a number in 0..1e+06"),
    ({"eval_data": "{eval}", "gate_vs_current": "yes"}, 400, "gate_vs_current", "true or"),
    ({"eval_data": "{eval}", "gate_repeats": 0}, 400, "gate_repeats", "an integer in 1..10"),
    ({"gate_repeats": 2}, 400, "eval_data", "needs an eval set"),
], ids=["gate-without-eval", "relative", "outside-root", "malformed", "metric", "margin",
        "flag", "no-repeats", "repeats-without-eval"])
async def test_bad_gate_options_are_refused_and_change_nothing(
        fake_replicas, tiny_model, checkpoint, eval_file, options, status, param, message):
    bad = eval_file.parent / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": \n')
    options = {k: v.format(eval=eval_file, bad=bad) if isinstance(v, str) else v
               for k, v in options.items()}
    got, body, versions = await gated(fake_replicas, tiny_model, checkpoint, base=ALL_RIGHT,
                                      new=ALL_RIGHT, **options)
    assert got == status, body
    assert body["error"]["param"] == param and message in body["error"]["message"]
    assert versions == [weights_for(str(tiny_model)).version] * 2


async def test_a_single_replica_cannot_be_gated(fake_replicas, tiny_model, checkpoint,
                                               eval_file):
    status, body, _ = await gated(fake_replicas, tiny_model, checkpoint, base=ALL_RIGHT,
                                  new=ALL_RIGHT, replicas=1, eval_data=str(eval_file),
                                  gate_min_score=0.5)
    assert status == 400 and body["error"]["param"] == "eval_data"
    assert "a single replica cannot" in body["error"]["message"]


async def test_the_scores_are_in_the_metrics(fake_replicas, tiny_model, checkpoint, eval_file):
    async with fleet(fake_replicas, tiny_model, 2) as f:
        for fake in f.fakes:
            fake.skill = {None: ALL_RIGHT, "step-000001": HALF_RIGHT}
        await deploy(f, checkpoint, eval_data=str(eval_file), gate_vs_current=True)
        async with httpx.AsyncClient(base_url=f.base) as c:
            text = (await c.get("/metrics")).text
    assert 'dpserve_deploy_eval_score{metric="exact_match",of="candidate"} 0.5' in text
    assert 'dpserve_deploy_eval_score{metric="exact_match",of="current"} 1.0' in text
    assert 'dpserve_deploy_eval_score{metric="mean_logprob",of="current"} -0.1' in text


async def test_dpserve_deploy_prints_the_scores_and_the_verdict(fake_replicas, tiny_model,
                                                                 checkpoint, eval_file):
    out = io.StringIO()
    async with fleet(fake_replicas, tiny_model, 2) as f, AdminClient(f.base) as client:
        for fake in f.fakes:
            fake.skill = {None: ALL_RIGHT, "step-000001": NONE_RIGHT}
        code = await run_deploy(client, checkpoint, {
            "eval_data": str(eval_file), "gate_vs_current": True}, out)
        status = io.StringIO()
        await run_status(client, status)
    text = out.getvalue()
    assert "gate failed" in status.getvalue().splitlines()[-1]  # `dpserve status`
    assert code == 1 and "rolled_back after" in text
    assert ("quality gate failed: exact_match 0 for the new version against 1 for the "
            "current one over 20 examples, a difference of -1 (95% interval -1..-1; 2 runs "
            "of one version differed by up to 0)") in text


async def test_a_lora_fleet_is_gated_on_exact_match_without_asking_the_prompts_logprobs(
        fake_replicas, tiny_model, checkpoint, eval_file):
    """Engines with LoRA enabled fail on batched prompt log-probabilities (vLLM 0.32):
    the gate asks them none, and refuses to gate on what it cannot measure."""
    async with fleet(fake_replicas, tiny_model, 2, enable_lora=True,
                     lora_affinity=False) as f:
        for fake in f.fakes:
            fake.skill = {None: ALL_RIGHT, "step-000001": HALF_RIGHT}
        refused, body = await deploy(f, checkpoint, eval_data=str(eval_file),
                                     gate_metric="mean_logprob", gate_min_score=-1)
        status, record = await deploy(f, checkpoint, eval_data=str(eval_file),
                                      gate_vs_current=True)
        asked = [r for fake in f.fakes for r in fake.requests if "prompt_logprobs" in r]
    assert refused == 409 and body["error"]["param"] == "gate_metric"
    assert "LoRA enabled" in body["error"]["message"]
    assert status == 202 and record["state"] == "rolled_back", record
    quality = record["quality"]
    assert quality["candidate"] == {"exact_match": 0.5, "mean_logprob": None, "examples": 20}
    assert quality["current"]["exact_match"] == 1.0 and quality["passed"] is False
    assert asked == []
