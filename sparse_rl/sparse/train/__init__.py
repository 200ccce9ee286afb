"""Indexer training (`sparse-rl indexer train`): data packing, the chunked KL losses, checkpoints and
the training loop. `kl.py` is pure tensor math; `trainer.py` wires it into a model."""
