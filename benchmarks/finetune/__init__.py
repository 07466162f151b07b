"""Fine-tuning: ``scaling`` (DDP at world size 1 and 2), ``memory`` (each strategy's
per-rank memory) and ``teardown`` (`dpserve finetune`'s exit code, soaked); ``configs/``
holds the model configs of the memory plans in README.md."""
