"""Where requests go: ``quality`` (dpserve's policies against vllm-router's on a simulated
fleet), ``vclock`` (the same in virtual time) and ``adapter`` (adapter affinity on real
replicas); the rest are their helpers."""
