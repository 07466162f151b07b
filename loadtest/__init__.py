"""dpserve's load generator: streaming OpenAI requests on a schedule, timed as
vLLM's benchmark times them (TTFT, TPOT, ITL, E2E latency), with throughput,
goodput, failures by reason and a per-replica breakdown.

    python -m loadtest run --base-url URL --model NAME --tokenizer DIR ...
    python -m loadtest sweep --request-rates 1,2,4,8 ...

Modules: `config` (settings), `datasets` (prompts), `arrivals` (when to send),
`client` (one timed request), `runner` (the load loop), `metrics` (numbers),
`harness` (a run end to end), `report` (JSON and tables), `plots` (PNG),
`fakes` (a scripted fake server), `cli`. See loadtest/README.md.
"""
