"""The settings of one load-test run, validated once; errors name the flag."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from loadtest.arrivals import RampUp
from loadtest.client import Endpoint
from loadtest.errors import ConfigError
from loadtest.metrics import SLO_METRICS

DatasetName = Literal["random", "jsonl", "sharegpt"]
DATASETS: tuple[DatasetName, ...] = ("random", "jsonl", "sharegpt")

DEFAULT_NUM_PROMPTS = 1000
DURATION_REQUEST_CAP = 1_000_000
"""Most requests a ``--duration`` run with no rate and no ``--num-prompts`` may send."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    base_url: str
    """The server's root URL, e.g. ``http://127.0.0.1:8000``."""
    other_base_urls: tuple[str, ...] = ()
    """More roots of the same service (``--base-url`` repeated: e.g. two routers in front
    of one fleet); requests go to each root in turn, ``base_url`` first."""
    model: str | None = None
    """Model name in requests; None: the first model the server lists."""
    endpoint: Endpoint = "completions"
    stream: bool = True

    dataset: DatasetName = "random"
    dataset_path: Path | None = None
    tokenizer: Path | None = None
    """Local directory of the model's tokenizer; None: ``model`` if it is a directory."""
    num_prompts: int | None = None
    """Requests to send (1000 if unset); with ``duration_s``, a cap on them."""
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    output_len: int | None = None
    """Output tokens of every request, overriding the dataset's."""
    seed: int = 0
    shuffle: bool = True
    ignore_eos: bool | None = None
    """None: on for the random dataset (so output lengths hold), off otherwise."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    ramp_up: RampUp | None = None
    max_concurrency: int | None = None
    duration_s: float | None = None
    """Stop sending new requests this many seconds after the start."""
    num_warmups: int = 0
    request_timeout_s: float = 600.0

    percentiles: tuple[float, ...] = (90.0, 95.0, 99.0)
    goodput_ms: dict[str, float] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_id_prefix: str = "loadtest-"

    result_json: Path | None = None
    save_detailed: bool = False
    plot_dir: Path | None = None
    """Where PNG plots go; None: beside ``result_json``."""
    plots: bool = True
    metadata: dict[str, str] = field(default_factory=dict)
    progress: bool = True

    def __post_init__(self) -> None:
        for url in self.base_urls:
            _require(url.startswith(("http://", "https://")), "--base-url",
                     "must start with http:// or https://", url)
        _require(self.dataset in DATASETS, "--dataset", f"must be one of {DATASETS}",
                 self.dataset)
        _require(self.dataset == "random" or self.dataset_path is not None, "--dataset-path",
                 f"is required with --dataset {self.dataset}", None)
        _require(self.num_prompts is None or self.num_prompts >= 1, "--num-prompts",
                 "must be >= 1", self.num_prompts)
        for name, value in (("--random-input-len", self.random_input_len),
                            ("--random-output-len", self.random_output_len),
                            ("--output-len", self.output_len or 1),
                            ("--request-timeout", self.request_timeout_s)):
            _require(value > 0, name, "must be > 0", value)
        _require(0.0 <= self.random_range_ratio < 1.0, "--random-range-ratio",
                 "must be in [0, 1)", self.random_range_ratio)
        _require(self.random_prefix_len >= 0, "--random-prefix-len", "must be >= 0",
                 self.random_prefix_len)
        _require(self.request_rate > 0, "--request-rate", "must be > 0 (inf: all at once)",
                 self.request_rate)
        _require(self.burstiness > 0, "--burstiness", "must be > 0", self.burstiness)
        _require(self.max_concurrency is None or self.max_concurrency >= 1,
                 "--max-concurrency", "must be >= 1", self.max_concurrency)
        _require(self.duration_s is None or self.duration_s > 0, "--duration", "must be > 0",
                 self.duration_s)
        _require(self.num_warmups >= 0, "--num-warmups", "must be >= 0", self.num_warmups)
        _require(not (self.duration_s and math.isinf(self.request_rate)
                      and self.ramp_up is None and self.max_concurrency is None),
                 "--duration", "needs --request-rate or --max-concurrency (else it would"
                 " send without limit)", self.duration_s)
        _require(all(0 < p < 100 for p in self.percentiles), "--metric-percentiles",
                 "must be in (0, 100)", self.percentiles)
        for name, limit in self.goodput_ms.items():
            _require(name in SLO_METRICS, "--goodput", f"metrics are {SLO_METRICS}", name)
            _require(limit >= 0, "--goodput", "SLOs must be >= 0 ms", limit)
        if self.ramp_up is not None:
            r = self.ramp_up
            _require(math.isinf(self.request_rate), "--ramp-up-strategy",
                     "sets the rate itself: leave out --request-rate", self.request_rate)
            _require(0 < r.start_rps <= r.end_rps, "--ramp-up-start-rps",
                     "must be > 0 and <= --ramp-up-end-rps", r.start_rps)

    @property
    def base_urls(self) -> tuple[str, ...]:
        return (self.base_url, *self.other_base_urls)

    @property
    def request_count(self) -> int:
        """Most requests the run sends (a ``--duration`` run may stop earlier)."""
        if self.num_prompts is not None:
            return self.num_prompts
        if self.duration_s is None or self.ramp_up is not None:
            return DEFAULT_NUM_PROMPTS
        if math.isinf(self.request_rate):
            return DURATION_REQUEST_CAP
        return math.ceil(self.request_rate * self.duration_s)

    @property
    def prompt_count(self) -> int:
        """Distinct prompts to build; requests go round them when there are more."""
        return min(self.request_count, self.num_prompts or DEFAULT_NUM_PROMPTS)

    @property
    def sends_ignore_eos(self) -> bool:
        return self.dataset == "random" if self.ignore_eos is None else self.ignore_eos


def parse_goodput(pairs: list[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            slos[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ConfigError(f"--goodput: expected METRIC:MILLISECONDS (e.g. ttft:500), "
                              f"got {pair!r}")
    return slos


def parse_key_values(pairs: list[str], flag: str) -> dict[str, str]:
    """``["a=1", "b=x=y"] -> {"a": "1", "b": "x=y"}``."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag}: expected KEY=VALUE, got {pair!r}")
        out[key.strip()] = value.strip()
    return out


def _require(ok: bool, flag: str, rule: str, value: object) -> None:
    if not ok:
        got = "" if value is None else f", got {value!r}"
        raise ConfigError(f"{flag} {rule}{got}")
