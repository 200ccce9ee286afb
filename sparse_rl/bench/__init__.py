"""Speed benchmarks behind `sparse-rl bench` (attention, decode, rollout); evaluation lives in `eval/`."""
