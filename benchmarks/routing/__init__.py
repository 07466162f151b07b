"""Where requests go: ``quality`` (dpserve's policies against vllm-router's on a simulated
fleet), ``vclock`` (the same in virtual time), ``adapter`` (adapter affinity on real
replicas), ``kv_index`` (the KV-event index's cost per call), ``kv_feed`` (the router's
event loop while replicas flood it with KV events) and ``tokenize`` (prompt
token ids as vLLM computes them, and the event loop's stall meanwhile); the rest are
their helpers."""
