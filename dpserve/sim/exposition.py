"""The simulated engine's Prometheus page, named and labelled as vLLM 0.32 names its own.

Read at scrape time from the engine's state and its counters (`dpserve.sim.metrics`).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from dpserve.sim.adapters import Adapters
from dpserve.sim.engine import Engine
from dpserve.sim.metrics import Histogram


def render(engine: Engine, adapters: Adapters | None = None) -> bytes:
    """The Prometheus text page of `engine` (and its replica's LoRA `adapters`: then
    `vllm:lora_requests_info` too, as vLLM with `--enable-lora`), read at call time."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(engine, adapters))
    return generate_latest(registry)


class _Collector:
    def __init__(self, engine: Engine, adapters: Adapters | None) -> None:
        self._engine = engine
        self._adapters = adapters

    def collect(self) -> Iterable[Metric]:
        e, s = self._engine, self._engine.stats
        labels = [e.config.model, "0"]

        def gauge(name: str, doc: str, value: float) -> Metric:
            m = GaugeMetricFamily(name, doc, labels=["model_name", "engine"])
            m.add_metric(labels, value)
            return m

        def counter(name: str, doc: str, value: float) -> Metric:
            m = CounterMetricFamily(name, doc, labels=["model_name", "engine"])
            m.add_metric(labels, value)
            return m

        def histogram(name: str, doc: str, h: Histogram) -> Metric:
            m = HistogramMetricFamily(name, doc, labels=["model_name", "engine"])
            m.add_metric(labels, h.buckets(), h.sum)
            return m

        yield gauge("vllm:num_requests_running",
                    "Number of requests in model execution batches.", e.num_running)
        yield gauge("vllm:num_requests_waiting",
                    "Number of requests waiting to be processed.", e.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    e.kv_cache_usage)
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.",
                      s.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.",
                      s.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      s.preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                      s.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      s.generation_tokens)
        success = CounterMetricFamily("vllm:request_success",
                                      "Count of successfully processed requests.",
                                      labels=["model_name", "engine", "finished_reason"])
        success.add_metric([*labels, "length"], s.requests_finished)
        success.add_metric([*labels, "abort"], s.requests_aborted)
        yield success
        yield histogram("vllm:time_to_first_token_seconds",
                        "Histogram of time to first token in seconds.", s.ttft)
        yield histogram("vllm:e2e_request_latency_seconds",
                        "Histogram of e2e request latency in seconds.", s.e2e)
        if self._adapters is not None:
            yield self._lora_info(self._adapters)
        error = HistogramMetricFamily(
            "dpserve_sim_step_timing_error_seconds",
            "How far the simulator's event loop missed engine steps' modelled deadlines, "
            "early or late; values above a millisecond mean the machine is too busy to "
            "simulate this load faithfully.", labels=["model_name"])
        error.add_metric([e.config.model], s.timing_error.buckets(), s.timing_error.sum)
        yield error

    def _lora_info(self, adapters: Adapters) -> Metric:
        """vLLM's `vllm:lora_requests_info`: one sample per label set it ever had, valued
        the wall time it was last current (no model or engine label). vLLM refreshes the
        current one every engine step; here, at every scrape while requests are in flight
        (and whenever one starts or ends)."""
        e = self._engine
        if e.num_running or e.num_waiting:
            adapters.record()
        m = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                              labels=["max_lora", "waiting_lora_adapters",
                                      "running_lora_adapters"])
        for labels, at in adapters.info.items():
            m.add_metric(list(labels), at)
        return m
