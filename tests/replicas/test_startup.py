"""A replica's start-up phase in dpserve's words, read from vLLM 0.32's own log lines."""

from __future__ import annotations

from pathlib import Path

from dpserve.replicas.startup import FIRST_PHASE, read_phase, startup_phase

HEADER = "\n===== dpserve: starting r0 on cpu:0: python -m vllm.entrypoints.openai.api_server\n"
# Lines of a real CPU start (vLLM 0.32), in order, the alarming ones included.
CPU_START = [
    "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
    "(APIServer pid=1) INFO 11-29 04:43:00 [api_utils.py:286] non-default args: {'host': ...}",
    "(APIServer pid=1) WARNING 11-29 04:43:00 [vllm.py:1703] Enforce eager set, disabling "
    "torch.compile, CUDAGraphs, and JIT kernel warmup.",
    "(EngineCore pid=2) INFO 11-29 04:43:21 [core.py:133] Initializing a V1 LLM engine "
    "(v0.32.0) with config: model='/m'",
    "(Worker pid=3) INFO 11-29 04:43:46 [cpu_model_runner.py:68] Starting to load model /m...",
    "Loading safetensors checkpoint shards: 100% Completed | 1/1",
    "(Worker pid=3) INFO 11-29 04:43:46 [default_loader.py:501] Loading weights took 0.03 s",
    "(EngineCore pid=2) INFO 11-29 04:43:52 [core.py:402] init engine (profile, create kv "
    "cache, warmup model) took 3.73 s",
    "(EngineCore pid=2) WARNING 11-29 04:43:54 [vllm.py:1703] Enforce eager set, disabling "
    "torch.compile, CUDAGraphs, and JIT kernel warmup.",
    "(APIServer pid=1) INFO 11-29 04:43:56 [entry.py:140] Starting vLLM server on "
    "http://127.0.0.1:51495",
]
PHASES_SEEN = [
    FIRST_PHASE, "reading the model's configuration", "reading the model's configuration",
    "starting the engine process", "loading the weights", "loading the weights",
    "measuring memory and sizing the KV cache", "starting the API server",
    "starting the API server", "the API server is up; waiting for /health to pass",
]


def test_each_line_of_a_cpu_start_moves_the_phase_on_and_never_back():
    for i, phase in enumerate(PHASES_SEEN):
        assert startup_phase(HEADER + "\n".join(CPU_START[:i + 1])) == phase, CPU_START[i]


def test_a_warning_that_mentions_compiling_is_not_the_compile_phase():
    """CPU engines print 'disabling torch.compile' after their init: no compile then."""
    assert startup_phase(HEADER + "\n".join(CPU_START[:9])) == "starting the API server"
    compiling = "(EngineCore pid=2) INFO [monitor.py:40] Starting torch.compile"
    assert startup_phase(HEADER + "\n".join([*CPU_START[:7], compiling])).startswith(
        "compiling the model")


def test_only_the_latest_launch_counts(tmp_path: Path):
    log = tmp_path / "replica-r0.log"
    assert read_phase(log) == FIRST_PHASE  # no log yet
    log.write_text(HEADER + "\n".join(CPU_START) + HEADER + CPU_START[1] + "\n")
    assert read_phase(log) == "reading the model's configuration"  # restarted
