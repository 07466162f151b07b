"""A fake NVML module, for the GPU collector on machines without a GPU.

`FakeNvml` has the functions and constants of `pynvml` (nvidia-ml-py) that
`dpserve.metrics.gpu` calls, with the same names, units (milliwatts,
millijoules, bytes, percent) and error type shape (`NVMLError.value` is the
NVML return code). GPUs can be told to fail one call, or all of them, with a
given NVML error code. Calls are recorded so tests can assert what was asked.
No latency: the collector's own cost is what the scrape benchmark measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

# The values pynvml uses (checked against it in tests/metrics/test_gpu.py).
NVML_TEMPERATURE_GPU = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"fake NVML error {value}")
        self.value = value


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    utilization_percent: int = 87
    memory_used: int = 70 * 2**30
    memory_total: int = 80 * 2**30
    power_mw: int = 412_345
    temperature_c: int = 61
    energy_mj: int = 9_876_543_210
    fail: dict[str, int] = field(default_factory=dict)
    """NVML function name (or "*" for every call on this GPU) → error code it raises."""


class FakeNvml:
    """Module-shaped: pass an instance where `pynvml` would go."""

    NVMLError = FakeNVMLError
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_LIBRARY_NOT_FOUND = NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST = NVML_ERROR_GPU_IS_LOST

    def __init__(self, gpus: list[FakeGpu], *, init_error: int | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.calls: list[str] = []
        self.initialised = False

    def _call(self, fn: str, handle: int | None = None) -> FakeGpu | None:
        self.calls.append(fn)
        if handle is None:
            return None
        gpu = self.gpus[handle]
        code = gpu.fail.get(fn, gpu.fail.get("*"))
        if code is not None:
            raise FakeNVMLError(code)
        return gpu

    def nvmlInit(self) -> None:
        self._call("nvmlInit")
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._call("nvmlDeviceGetHandleByIndex", index)
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        gpu = self._call("nvmlDeviceGetUUID", handle)
        assert gpu is not None
        return gpu.uuid

    def nvmlDeviceGetName(self, handle: int) -> str:
        gpu = self._call("nvmlDeviceGetName", handle)
        assert gpu is not None
        return gpu.name

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        gpu = self._call("nvmlDeviceGetUtilizationRates", handle)
        assert gpu is not None
        return SimpleNamespace(gpu=gpu.utilization_percent, memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        gpu = self._call("nvmlDeviceGetMemoryInfo", handle)
        assert gpu is not None
        return SimpleNamespace(total=gpu.memory_total, used=gpu.memory_used,
                               free=gpu.memory_total - gpu.memory_used)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        gpu = self._call("nvmlDeviceGetPowerUsage", handle)
        assert gpu is not None
        return gpu.power_mw

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        gpu = self._call("nvmlDeviceGetTemperature", handle)
        assert gpu is not None and sensor == NVML_TEMPERATURE_GPU
        return gpu.temperature_c

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        gpu = self._call("nvmlDeviceGetTotalEnergyConsumption", handle)
        assert gpu is not None
        return gpu.energy_mj


def fake_gpus(n: int) -> list[FakeGpu]:
    return [FakeGpu(uuid=f"GPU-fake-{i:04d}") for i in range(n)]
