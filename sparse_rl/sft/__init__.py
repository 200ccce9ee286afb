"""Supervised fine-tuning (`sparse-rl sft`): data (formats, loss mask, packing) and the trainer."""
