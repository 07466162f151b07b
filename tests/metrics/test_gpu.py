"""The NVML collector, on a fake NVML module (CPU machines) and on a real GPU where there is one."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dpserve.metrics import fake_nvml
from dpserve.metrics.fake_nvml import FakeGpu, FakeNvml, fake_gpus
from dpserve.metrics.gpu import GpuCollector, gpu_replicas, load_nvml


def samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    text = generate_latest(registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def scrape(nvml: FakeNvml, replicas: dict[int, str] | None = None) -> dict:
    collector = GpuCollector.open(nvml, replicas=lambda: replicas or {})
    assert collector is not None
    registry = CollectorRegistry()
    registry.register(collector)
    return samples(registry)


def gpu_labels(i: int, replica: str) -> frozenset:
    return frozenset({"gpu": str(i), "uuid": f"GPU-fake-{i:04d}",
                      "name": "NVIDIA H100 80GB HBM3", "replica": replica}.items())


def test_fake_nvml_matches_pynvml_names_and_codes():
    pynvml = load_nvml()
    assert pynvml is not None, "nvidia-ml-py is a dependency of dpserve"
    for name in dir(FakeNvml):
        if name.startswith("nvml"):
            assert callable(getattr(pynvml, name)), name
    for const in ("NVML_TEMPERATURE_GPU", "NVML_ERROR_NOT_SUPPORTED",
                  "NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_GPU_IS_LOST"):
        assert getattr(fake_nvml, const) == getattr(pynvml, const), const


def test_every_gpu_is_reported_in_base_units_and_labelled_with_its_replica():
    got = scrape(FakeNvml(fake_gpus(2)), {0: "r0", 1: "r1"})
    for i in (0, 1):
        labels = gpu_labels(i, f"r{i}")
        assert got[("dpserve_gpu_utilization_ratio", labels)] == pytest.approx(0.87)
        assert got[("dpserve_gpu_memory_used_bytes", labels)] == 70 * 2**30
        assert got[("dpserve_gpu_memory_total_bytes", labels)] == 80 * 2**30
        assert got[("dpserve_gpu_power_watts", labels)] == pytest.approx(412.345)
        assert got[("dpserve_gpu_temperature_celsius", labels)] == 61
        assert got[("dpserve_gpu_energy_joules_total", labels)] == pytest.approx(9_876_543.21)


def test_each_gpu_names_its_replica_and_uuid_for_a_join_with_dcgm():
    got = scrape(FakeNvml(fake_gpus(3)), {0: "r0", 2: "r1"})
    info = {dict(labels)["uuid"]: dict(labels) for (name, labels), v in got.items()
            if name == "dpserve_replica_gpu_info" and v == 1}
    assert info == {f"GPU-fake-{i:04d}": {"replica": r, "gpu": str(i),
                                          "uuid": f"GPU-fake-{i:04d}",
                                          "name": "NVIDIA H100 80GB HBM3"}
                    for i, r in ((0, "r0"), (1, "none"), (2, "r1"))}


def test_a_gpu_no_replica_uses_is_labelled_none():
    got = scrape(FakeNvml(fake_gpus(2)), {1: "r0"})
    assert ("dpserve_gpu_power_watts", gpu_labels(0, "none")) in got
    assert ("dpserve_gpu_power_watts", gpu_labels(1, "r0")) in got


def test_a_failing_field_drops_only_its_samples_and_is_counted():
    gpus = fake_gpus(2)
    gpus[1].fail["nvmlDeviceGetPowerUsage"] = fake_nvml.NVML_ERROR_UNKNOWN
    got = scrape(FakeNvml(gpus), {0: "r0", 1: "r1"})
    assert ("dpserve_gpu_power_watts", gpu_labels(1, "r1")) not in got
    assert ("dpserve_gpu_power_watts", gpu_labels(0, "r0")) in got
    assert ("dpserve_gpu_memory_used_bytes", gpu_labels(1, "r1")) in got
    errors = frozenset({"gpu": "1", "field": "power"}.items())
    assert got[("dpserve_gpu_scrape_errors_total", errors)] == 1
    assert got[("dpserve_gpu_scrape_errors_total",
                frozenset({"gpu": "0", "field": "power"}.items()))] == 0


def test_a_lost_gpu_leaves_the_others_and_the_scrape_intact():
    gpus = fake_gpus(3)
    gpus[1].fail["*"] = fake_nvml.NVML_ERROR_GPU_IS_LOST
    nvml = FakeNvml(gpus)
    collector = GpuCollector.open(nvml)
    assert collector is not None
    registry = CollectorRegistry()
    registry.register(collector)
    samples(registry)
    got = samples(registry)
    reported = {dict(labels)["gpu"] for name, labels in got
                if name == "dpserve_gpu_utilization_ratio"}
    assert reported == {"0", "2"}
    assert got[("dpserve_gpu_scrape_errors_total",
                frozenset({"gpu": "1", "field": "device"}.items()))] == 2
    gpus[1].fail.clear()  # back (after a reset): reported again
    assert ("dpserve_gpu_utilization_ratio", gpu_labels(1, "none")) in samples(registry)


def test_a_field_the_gpu_does_not_support_is_counted_once_and_not_asked_again():
    unsupported = fake_nvml.NVML_ERROR_NOT_SUPPORTED
    gpus = [FakeGpu(uuid="GPU-fake-0000",
                    fail={"nvmlDeviceGetTotalEnergyConsumption": unsupported})]
    nvml = FakeNvml(gpus)
    collector = GpuCollector.open(nvml)
    assert collector is not None
    registry = CollectorRegistry()
    registry.register(collector)
    for _ in range(3):
        got = samples(registry)
    assert nvml.calls.count("nvmlDeviceGetTotalEnergyConsumption") == 1
    assert got[("dpserve_gpu_scrape_errors_total",
                frozenset({"gpu": "0", "field": "energy"}.items()))] == 1
    assert ("dpserve_gpu_power_watts", gpu_labels(0, "none")) in got


def test_registering_the_collector_does_not_call_nvml():
    nvml = FakeNvml(fake_gpus(1))
    collector = GpuCollector.open(nvml)
    assert collector is not None
    before = list(nvml.calls)
    CollectorRegistry(auto_describe=True).register(collector)
    assert nvml.calls == before


def test_no_collector_without_nvml_or_without_gpus():
    assert GpuCollector.open(None) is None
    no_library = FakeNvml([], init_error=fake_nvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    assert GpuCollector.open(no_library) is None
    empty = FakeNvml([])
    assert GpuCollector.open(empty) is None
    assert not empty.initialised  # shut down again


def test_close_shuts_nvml_down():
    nvml = FakeNvml(fake_gpus(1))
    collector = GpuCollector.open(nvml)
    assert collector is not None and nvml.initialised
    collector.close()
    assert not nvml.initialised


def test_gpu_replicas_maps_gpu_devices_and_ignores_cpu_ones():
    assert gpu_replicas([("r0", "gpu:2"), ("r1", "gpu:5"), ("r2", "cpu:0,1"),
                         ("r3", "remote")]) == {2: "r0", 5: "r1"}


def _nvml_gpu_count() -> int:
    nvml = load_nvml()
    if nvml is None:
        return 0
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return 0
    try:
        return int(nvml.nvmlDeviceGetCount())
    finally:
        nvml.nvmlShutdown()


@pytest.mark.skipif(_nvml_gpu_count() == 0,
                    reason="no NVIDIA GPU visible to NVML (no driver library or no device); "
                           "the fake-NVML tests above cover the collector")
def test_real_nvml_reports_every_gpu_in_plausible_units():
    collector = GpuCollector.open(load_nvml(), replicas=lambda: {0: "r0"})
    assert collector is not None
    try:
        registry = CollectorRegistry()
        registry.register(collector)
        got = samples(registry)
    finally:
        collector.close()
    total = {dict(labels)["gpu"]: value for (name, labels), value in got.items()
             if name == "dpserve_gpu_memory_total_bytes"}
    assert len(total) == collector.count
    assert all(v > 2**30 for v in total.values())  # bytes, not MiB
    for (name, labels), value in got.items():
        if name == "dpserve_gpu_utilization_ratio":
            assert 0.0 <= value <= 1.0
        if name == "dpserve_gpu_power_watts":
            assert 1.0 < value < 2000.0  # watts, not milliwatts
        if name == "dpserve_gpu_memory_used_bytes":
            assert value <= total[dict(labels)["gpu"]]
    assert any(dict(labels).get("replica") == "r0" for _, labels in got)
