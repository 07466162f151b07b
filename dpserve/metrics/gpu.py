"""Per-GPU metrics read from NVML when Prometheus scrapes, not by a background thread.

:class:`GpuCollector` is a Prometheus collector over an NVML module (the
`pynvml` of `nvidia-ml-py`, or a fake with the same functions in tests). Each
scrape asks NVML for every GPU's utilization, memory, power, temperature and
energy, converts them to base units (NVML gives milliwatts and millijoules)
and labels them `gpu` (NVML index), `uuid`, `name` and `replica`, the replica
whose `CUDA_VISIBLE_DEVICES` names that index (`none` for a GPU no replica
uses).

A failing NVML call drops only the samples it would have given and counts in
`dpserve_gpu_scrape_errors_total{gpu,field}`: a lost GPU or a field the driver
does not support never fails `/metrics`. A field NVML reports as not supported
on a GPU is counted once and not asked for again on that GPU.

GPU index ↔ replica: the launcher hands each replica an NVML index (as
`nvidia-smi` numbers them, in PCI bus order) in `CUDA_VISIBLE_DEVICES`, with
`CUDA_DEVICE_ORDER=PCI_BUS_ID` so CUDA numbers the GPUs the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("dpserve.metrics.gpu")

NO_REPLICA = "none"
LABELS = ("gpu", "uuid", "name", "replica")
# One name per NVML call: an error drops that call's samples and counts under it.
FIELDS = ("utilization", "memory", "power", "temperature", "energy")


def load_nvml() -> Any | None:
    """The `pynvml` module of nvidia-ml-py, or None if it is not installed."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def gpu_replicas(devices: Iterable[tuple[str, str]]) -> dict[int, str]:
    """Map GPU index → replica id from (replica id, device) pairs such as ("r0", "gpu:3")."""
    found: dict[int, str] = {}
    for replica_id, device in devices:
        kind, _, index = device.partition(":")
        if kind == "gpu" and index.isdigit():
            found[int(index)] = replica_id
    return found


def _text(value: str | bytes) -> str:
    # nvidia-ml-py returns str; older bindings returned bytes.
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class GpuCollector(Collector):
    """Prometheus collector of every GPU NVML sees; build it with :meth:`open`."""

    def __init__(self, nvml: Any, count: int,
                 replicas: Callable[[], Mapping[int, str]] = dict) -> None:
        self._nvml = nvml
        self._count = count
        self._replicas = replicas
        self._identity: dict[int, tuple[Any, str, str]] = {}  # index → (handle, uuid, name)
        self._unsupported: set[tuple[int, str]] = set()
        self._errors = {(i, f): 0 for i in range(count) for f in (*FIELDS, "device")}

    @classmethod
    def open(cls, nvml: Any | None,
             replicas: Callable[[], Mapping[int, str]] = dict) -> GpuCollector | None:
        """Initialise NVML; None where there is no NVML library, driver or GPU."""
        if nvml is None:
            return None
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            log.debug("no NVML: %s", exc)
            return None
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            log.warning("NVML initialised but cannot count GPUs (%s); no GPU metrics", exc)
            count = 0
        if count == 0:
            nvml.nvmlShutdown()
            return None
        return cls(nvml, count, replicas)

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:
            log.debug("nvmlShutdown: %s", exc)

    @property
    def count(self) -> int:
        return self._count

    def describe(self) -> Iterable[Metric]:
        # Registering must not call NVML: describe the families, without samples.
        return self._families()

    def _families(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=LABELS)

        return [
            gauge("dpserve_gpu_utilization_ratio",
                  "Fraction of the last sample period in which a kernel ran on the GPU (NVML)."),
            gauge("dpserve_gpu_memory_used_bytes", "GPU memory in use."),
            gauge("dpserve_gpu_memory_total_bytes", "GPU memory installed."),
            gauge("dpserve_gpu_power_watts", "GPU power draw."),
            gauge("dpserve_gpu_temperature_celsius", "GPU core temperature."),
            CounterMetricFamily("dpserve_gpu_energy_joules",
                                "Energy used by the GPU since the driver loaded.",
                                labels=LABELS),
            CounterMetricFamily("dpserve_gpu_scrape_errors",
                                "NVML calls that failed during a scrape; their samples "
                                "were left out.", labels=("gpu", "field")),
            GaugeMetricFamily("dpserve_replica_gpu_info",
                              "1 for each GPU, naming the replica it serves: join "
                              "dcgm-exporter's series to replicas by UUID.",
                              labels=("replica", "gpu", "uuid", "name")),
        ]

    def collect(self) -> Iterable[Metric]:
        util, used, total, power, temp, energy, errors, info = families = self._families()
        replicas = self._replicas()
        nvml = self._nvml
        for i in range(self._count):
            identity = self._device(i)
            if identity is None:
                continue
            handle, uuid, name = identity
            labels = [str(i), uuid, name, replicas.get(i, NO_REPLICA)]
            info.add_metric([labels[3], str(i), uuid, name], 1.0)

            if (rates := self._read(i, "utilization", nvml.nvmlDeviceGetUtilizationRates,
                                    handle)) is not None:
                util.add_metric(labels, rates.gpu / 100.0)
            if (memory := self._read(i, "memory", nvml.nvmlDeviceGetMemoryInfo,
                                     handle)) is not None:
                used.add_metric(labels, float(memory.used))
                total.add_metric(labels, float(memory.total))
            if (mw := self._read(i, "power", nvml.nvmlDeviceGetPowerUsage, handle)) is not None:
                power.add_metric(labels, mw / 1000.0)
            if (celsius := self._read(i, "temperature", nvml.nvmlDeviceGetTemperature,
                                      handle, nvml.NVML_TEMPERATURE_GPU)) is not None:
                temp.add_metric(labels, float(celsius))
            if (mj := self._read(i, "energy", nvml.nvmlDeviceGetTotalEnergyConsumption,
                                 handle)) is not None:
                energy.add_metric(labels, mj / 1000.0)
        for (i, field), n in self._errors.items():
            errors.add_metric([str(i), field], n)
        return families

    def _device(self, i: int) -> tuple[Any, str, str] | None:
        """Handle, UUID and name of GPU i, cached once read; None (counted) if NVML fails."""
        if (known := self._identity.get(i)) is not None:
            return known
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            identity = (handle, _text(nvml.nvmlDeviceGetUUID(handle)),
                        _text(nvml.nvmlDeviceGetName(handle)))
        except Exception as exc:  # a scrape must not fail on one GPU
            self._count_error(i, "device", exc)
            return None
        self._identity[i] = identity
        return identity

    def _read(self, i: int, field: str, call: Callable[..., Any], *args: Any) -> Any | None:
        if (i, field) in self._unsupported:
            return None
        try:
            return call(*args)
        except Exception as exc:  # NVMLError or a broken binding alike
            if getattr(exc, "value", None) == getattr(self._nvml, "NVML_ERROR_NOT_SUPPORTED",
                                                      object()):
                self._unsupported.add((i, field))
            elif getattr(exc, "value", None) == getattr(self._nvml, "NVML_ERROR_GPU_IS_LOST",
                                                        object()):
                self._identity.pop(i, None)  # re-read the handle next time
            self._count_error(i, field, exc)
            return None

    def _count_error(self, i: int, field: str, exc: BaseException) -> None:
        self._errors[(i, field)] = self._errors.get((i, field), 0) + 1
        log.debug("NVML %s on GPU %d failed: %s: %s", field, i, type(exc).__name__, exc)
