"""Where requests go: ``quality`` (dpserve's policies against vllm-router's on a simulated
fleet), ``vclock`` (the same in virtual time), ``adapter`` (adapter affinity on real
replicas) and ``kv_index`` (the KV-event index's cost per call); the rest are their
helpers."""
