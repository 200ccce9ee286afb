"""The dense model's per-token elementwise work in a decode step, fused: residual add + RMSNorm, q/k
RMSNorm (Qwen3) + RoPE + the K/V cache write, and the gated MLP's SiLU(gate) * up (see `ops.add_rmsnorm`,
`ops.qk_norm_rope_cache`, `ops.silu_mul`)."""
