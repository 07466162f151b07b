"""dpserve's load generator: streaming OpenAI requests, TTFT/TPOT/E2E latency.

A first, small version: closed-loop concurrency over a fixed prompt. Metric
definitions follow vLLM's benchmark: TTFT is the time to the first streamed
token, TPOT = (E2E - TTFT) / (output tokens - 1).
"""
