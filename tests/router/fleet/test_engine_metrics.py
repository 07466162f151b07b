from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from dpserve.router.fleet.engine_metrics import EngineLoad, parse_engine_metrics

# Scraped from a real vLLM 0.32 CPU server (tiny model, --max-num-seqs 2) with
# five long completions sent: two running, three queued.
RECORDED = (Path(__file__).parent / "data" / "vllm_0.32_cpu_metrics.txt").read_text()


def test_a_real_vllm_scrape_reads_as_its_queue_and_cache():
    load = parse_engine_metrics(RECORDED)
    assert load.num_requests_running == 2
    assert load.num_requests_waiting == 3
    assert load.num_requests == 5
    assert load.kv_cache_usage_perc == 0.0009766817238432424
    assert load.prefix_cache_queries == 192.0
    assert load.prefix_cache_hits == 0.0
    assert load.prefix_cache_hit_ratio == 0.0


def test_values_are_combined_over_engines_and_models():
    text = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a"} 3.0
vllm:num_requests_running{engine="1",model_name="a"} 4.0
vllm:num_requests_waiting{engine="0",model_name="a"} 1.0
vllm:num_requests_waiting{engine="1",model_name="a"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="a"} 0.75
vllm:prefix_cache_queries_total{engine="0",model_name="a"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="a"} 300.0
vllm:prefix_cache_hits_total{engine="0",model_name="a"} 50.0
vllm:prefix_cache_hits_total{engine="1",model_name="a"} 50.0
vllm:prefix_cache_hits_created{engine="1",model_name="a"} 1.7e+09
"""
    assert parse_engine_metrics(text) == EngineLoad(
        num_requests_running=7, num_requests_waiting=1, kv_cache_usage_perc=0.75,
        prefix_cache_queries=400.0, prefix_cache_hits=100.0)
    assert parse_engine_metrics(text).prefix_cache_hit_ratio == 0.25


def test_label_values_with_spaces_braces_and_quotes_do_not_confuse_the_parser():
    text = ('vllm:num_requests_running{model_name="a } b \\" c",engine="0"} 2 1700000000000\n'
            'vllm:num_requests_waiting 5\n')
    load = parse_engine_metrics(text)
    assert (load.num_requests_running, load.num_requests_waiting) == (2, 5)


def test_missing_metrics_are_unknown_not_zero():
    load = parse_engine_metrics("# nothing here\nprocess_cpu_seconds_total 3.5\n")
    assert load == EngineLoad()
    assert load.num_requests is None
    assert load.prefix_cache_hit_ratio is None


def test_one_of_running_or_waiting_is_enough_for_a_queue_length():
    assert parse_engine_metrics("vllm:num_requests_waiting 4\n").num_requests == 4


def test_garbage_and_nan_samples_are_skipped():
    text = ("vllm:num_requests_running{engine=\"0\" 3\n"   # unterminated labels
            "vllm:num_requests_running{engine=\"1\"} many\n"
            "vllm:num_requests_running{engine=\"2\"} 1\n"
            "vllm:kv_cache_usage_perc NaN\n"
            "{orphan=\"label\"} 1\n")
    load = parse_engine_metrics(text)
    assert load.num_requests_running == 1
    assert load.kv_cache_usage_perc is None


LORA = """\
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="1",running_lora_adapters="a@1",waiting_lora_adapters=""} 1.76e+09
vllm:lora_requests_info{max_lora="1",running_lora_adapters="b@2",waiting_lora_adapters="a@1,c@3"} \
1.77e+09
vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""} 1.75e+09
"""


def test_the_newest_adapter_report_is_the_engines_state_now():
    load = parse_engine_metrics(LORA)
    assert load.lora_running == frozenset({"b@2"})
    assert load.lora_waiting == frozenset({"a@1", "c@3"})
    assert load.max_loras == 1
    assert load.lora_at == 1.77e9


def test_an_engine_without_adapters_reports_no_adapter_state():
    load = parse_engine_metrics(RECORDED)
    assert (load.lora_running, load.lora_waiting, load.max_loras, load.lora_at) == (
        None, None, None, None)


def test_adapter_labels_are_unescaped_and_a_malformed_block_reads_as_empty():
    text = ('vllm:lora_requests_info{waiting_lora_adapters="",max_lora="x",'
            'running_lora_adapters="odd\\\\name,q\\"uote"} 5\n')
    load = parse_engine_metrics(text)
    assert load.lora_running == frozenset({"odd\\name", 'q"uote'})
    assert load.max_loras is None  # not a number: unknown, not guessed
    broken = parse_engine_metrics('vllm:lora_requests_info{running_lora_adapters="a 5\n')
    assert broken.lora_running is None
    unquoted = parse_engine_metrics("vllm:lora_requests_info{running_lora_adapters=a} 5\n")
    assert unquoted.lora_running == frozenset()


NAMES = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)


def escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@given(st.lists(NAMES.filter(lambda n: n and "," not in n), max_size=4),
       st.lists(NAMES.filter(lambda n: n and "," not in n), max_size=4),
       st.integers(1, 64))
def test_any_adapter_names_the_engine_reports_read_back_as_they_were(run, wait, slots):
    labels = (f'max_lora="{slots}",running_lora_adapters="{escaped(",".join(run))}",'
              f'waiting_lora_adapters="{escaped(",".join(wait))}"')
    load = parse_engine_metrics(f"vllm:lora_requests_info{{{labels}}} 1.7e+09\n")
    assert (load.lora_running, load.lora_waiting, load.max_loras) == (
        frozenset(run), frozenset(wait), slots)


@given(st.text(max_size=200))
def test_any_text_parses_without_raising(text):
    parse_engine_metrics("vllm:lora_requests_info{" + text)
    parse_engine_metrics(text)
