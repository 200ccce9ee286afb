#!/usr/bin/env bash
# Issue 17 learnability pilot (session 6): five variants of the look-up task side by side on one GPU,
# each trained for SECONDS with tables lengthened by time; curves in $OUT/pilot/<name>.json.
#   usage: bash benchmarks/gpu_evidence_pilot6.sh SECONDS
set -u
S=${1:-200}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
O=$OUT/pilot; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv > $O/gpu.txt 2>&1
run() { n=$1; shift; python benchmarks/gpu_evidence_pilot6.py --name $n --seconds $S --out /tmp/pilot "$@" > $O/$n.log 2>&1; cp /tmp/pilot/$n.json $O/ 2>/dev/null; }
run A --size small  --digits 2 --hops 2 --rows 8,24,40 --lr 2e-3 &
run B --size small  --digits 3 --hops 2 --rows 8,32,96 --lr 2e-3 &
run C --size small  --digits 4 --hops 2 --rows 8,32,96 --lr 2e-3 &
run D --size medium --digits 3 --hops 2 --rows 8,32,96 --lr 1e-3 &
run E --size small  --digits 3 --hops 2 --rows 8,32,96 --lr 4e-3 &
wait
for n in A B C D E; do echo "== $n"; grep -v Warn $O/$n.log | tail -n 4 | cut -c1-400; done
