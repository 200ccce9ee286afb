#!/usr/bin/env bash
# The DistillSparse / Sparrow evidence run on one GPU (docs/RESULTS.md is written from its files):
#   part 1: pre-train a small model from scratch on chained look-ups, SFT, convert, indexer warm-up;
#   part 2: GRPO in four modes (dense; sparse; sparse + truncated IS; sparse + LoRA distill + oversampling);
#   part 3: each final policy: held-out accuracy dense / sparse, fidelity, NIAH; results.json + RESULTS.md.
# Launch:   bash recipes/evidence/run.sh OUT                 (SIZE=gpu, all parts)
#           SIZE=cpu bash recipes/evidence/run.sh OUT        (the CPU smoke version, tiny sizes)
#           PART=2 bash recipes/evidence/run.sh OUT          (one part; OUT/part1/handoff must be there)
# Re-running continues: a stage whose OUT/.done/<stage> marker exists is skipped. EV_<KEY>=value
# overrides one size (the keys of SIZES in recipes/evidence/run.py), e.g. EV_GRPO_STEPS=20.
# Afterwards: cp OUT/RESULTS.md docs/RESULTS.md
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true  # sft tokenizes a file in batched, parallel calls
exec python "$here/run.py" "$@"
