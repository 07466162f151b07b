"""Deploys under load: ``rollout``, ``adapter`` (a LoRA adapter against hot-loading it
merged), ``canary_baseline``, ``quality_gate`` and ``validate_offload``; ``windows`` is the
deploy and steady windows the first two report on."""
