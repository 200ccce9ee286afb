"""The lightning indexer's per-token work at decode time: scales, LayerNorm, RoPE and the index-key
cache write, after its three projections (see `ops.indexer_decode`)."""
