"""The dense model's per-token elementwise work in a decode step, fused: residual add + RMSNorm, and
q/k RMSNorm (Qwen3) + RoPE + the K/V cache write (see `ops.add_rmsnorm`, `ops.qk_norm_rope_cache`)."""
