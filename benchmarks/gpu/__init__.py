"""What CI cannot check without a CUDA GPU: ``check.sh`` drives ``check``'s subcommands."""
