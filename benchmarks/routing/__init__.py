"""Where requests go: ``quality`` (dpserve's policies against vllm-router's on a simulated
fleet), ``vclock`` (the same in virtual time), ``adapter`` (adapter affinity on real
replicas), ``kv_index`` (the KV-event index's cost per call) and ``tokenize`` (prompt
token ids as vLLM computes them, and the event loop's stall meanwhile); the rest are
their helpers."""
