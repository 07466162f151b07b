"""`dpserve finetune`: PyTorch DDP fine-tuning whose checkpoints vLLM serves."""
