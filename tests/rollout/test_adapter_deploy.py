"""What `AdapterDeploys` refuses before any engine is touched, beyond the adapter's own
checks (`test_validate_adapter.py`): a version that is already loaded, whether it
serves or is still finishing the requests of a replaced version."""

from __future__ import annotations

import pytest

from dpserve import checkpoint as ckpt
from dpserve.rollout.adapter_deploy import AdapterDeploys
from dpserve.rollout.validate import Refused
from dpserve.router.fleet.adapters import Adapters, AdapterVersion
from dpserve.router.fleet.pool import ReplicaPool
from tests.fakes import MODEL
from tests.rollout.checkpoints import perturbed, write_adapter, write_variant
from tests.rollout.fleet import deploy, fleet, take_down


def deploys() -> AdapterDeploys:
    return AdapterDeploys(ReplicaPool([]), Adapters(), enabled=True, max_lora_rank=8)


def test_an_adapter_checked_against_the_served_weights_becomes_a_version(tiny_model, tmp_path):
    path, meta = write_adapter(tiny_model, tmp_path)
    version = deploys().validate("support", path, meta, served_weights=tiny_model)
    assert version.name == "support" and version.rank == 4 and not version.serving
    assert version.version.startswith("step-000007@") and version.path == str(path)


def test_weights_a_full_deploy_checked_are_not_read_again_for_an_adapter(tiny_model, tmp_path,
                                                                        monkeypatch):
    served = write_variant(tiny_model, tmp_path / "full", 1, tensors=perturbed(0.01, seed=1))
    fits, fits_meta = write_adapter(served, tmp_path / "fits")
    other, other_meta = write_adapter(tiny_model, tmp_path / "other")
    d = deploys()
    d.know_weights(str(served), ckpt.read_meta(served))
    monkeypatch.setattr(ckpt, "sha256_file", lambda path: pytest.fail(f"read {path}"))
    assert d.validate("support", fits, fits_meta, served_weights=served).rank == 4
    with pytest.raises(Refused) as exc:
        d.validate("support", other, other_meta, served_weights=served)
    assert exc.value.status == 409 and "other" in exc.value.message


@pytest.mark.parametrize(("retiring", "message"), [
    (False, "support already serves version step-000007@"),
    (True, "was replaced and is still finishing its requests"),
])
def test_a_version_already_loaded_is_refused(tiny_model, tmp_path, retiring, message):
    path, meta = write_adapter(tiny_model, tmp_path)
    d = deploys()
    v = d.validate("support", path, meta, served_weights=tiny_model)
    d.adapters.add(v)
    d.adapters.switch(v)
    if retiring:
        d.adapters.add(newer := AdapterVersion("support", "newer", "/snap/newer", 4))
        d.adapters.switch(newer)
    with pytest.raises(Refused) as exc:
        d.validate("support", path, meta, served_weights=tiny_model)
    assert exc.value.status == 409 and message in exc.value.message


@pytest.mark.parametrize(("name", "status", "message"), [
    ("tiny", 409, "is the served base model's name"),
    ("a/b", 400, "must be 1-64 letters"),
    ("x@1", 400, "must be 1-64 letters"),
])
def test_names_that_cannot_serve_an_adapter_are_refused(name, status, message):
    with pytest.raises(Refused) as exc:
        deploys().check_request(name, frozenset({"tiny"}))
    assert exc.value.status == status and message in exc.value.message


def test_a_name_is_not_checked_against_nothing():
    with pytest.raises(Refused) as exc:
        deploys().check_request("support", frozenset())
    assert exc.value.status == 409 and "no replica has reported" in exc.value.message


async def test_the_base_models_name_is_refused_while_no_replica_is_ready(
        fake_replicas, tiny_model, tmp_path):
    """The check reads what every replica reported, not only the ready ones: with the
    fleet down (or draining, restarting) an adapter could otherwise take the base
    model's name, and every request for the base would run on the adapter."""
    async with fleet(fake_replicas, tiny_model, 2, enable_lora=True) as f:
        for i in range(2):
            await take_down(f, i)
        assert f.router.pool.served_models() == frozenset()
        path, _ = write_adapter(tiny_model, tmp_path)
        status, refused = await deploy(f, path, name=MODEL)
    assert status == 409 and refused["error"]["param"] == "name"
    assert "base model's name" in refused["error"]["message"]
    assert f.rollout.adapters is not None and not f.rollout.adapters.adapters.in_use


def test_replicas_without_adapters_refuse_saying_how_to_start_them():
    d = AdapterDeploys(ReplicaPool([]), Adapters(), enabled=False, max_lora_rank=8)
    with pytest.raises(Refused) as exc:
        d.check_request("support", frozenset())
    assert exc.value.status == 409 and "--enable-lora" in exc.value.message


async def test_an_adapter_of_another_base_is_refused_naming_it_as_deployed(
        fake_replicas, tiny_model, tmp_path):
    """The check runs on the snapshot's copy; the refusal names the path deployed."""
    async with fleet(fake_replicas, tiny_model, 2, enable_lora=True) as f:
        path, _ = write_adapter(tiny_model, tmp_path, extra={"base_fingerprint": "ab" * 32})
        status, refused = await deploy(f, path, name="support")
    message = refused["error"]["message"]
    assert status == 409 and message.startswith(f"{path}: adapter was trained on base "), message
    assert f.rollout.adapters is not None and not f.rollout.adapters.adapters.in_use
