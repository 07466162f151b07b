"""Rolling hot-load of fine-tuned checkpoints into running vLLM replicas.

- `deployed`: which weights every replica should serve (the supervisor restarts
  replicas on them; the rollout changes them).
- `validate`: is a directory a complete checkpoint that fits the served model?
  Answered from metadata, hashes and safetensors headers, before any replica changes.
- `validate_adapter`: the same for a LoRA adapter loaded beside the served base
  (its config, its base's fingerprint, its tensors against the base's linear layers).
- `engine_admin`: the vLLM dev endpoints a hot-load needs (pause, reload, resume...).
- `rollout`: the rolling state machine, one deploy at a time, with rollback.
- `api`: `/admin/deploy` routes; `client`: what `dpserve deploy` and `dpserve status` call.

Named `rollout`, not `deploy`, so it never clashes with the top-level `deploy/`
folder of manifests. Importing this package does no work.
"""
