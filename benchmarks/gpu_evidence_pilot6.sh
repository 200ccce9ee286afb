#!/usr/bin/env bash
# Issue 17 learnability pilot (session 6): five variants of the look-up task side by side on one GPU,
# each trained for SECONDS with tables lengthened by time; curves in $OUT/pilot/<name>.json.
#   usage: bash benchmarks/gpu_evidence_pilot6.sh SECONDS
set -u
S=${1:-200}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
O=$OUT/pilot; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv > $O/gpu.txt 2>&1
run() { n=$1; shift; python benchmarks/gpu_evidence_pilot6.py --name $n --seconds $S --out /tmp/pilot "$@" > $O/$n.log 2>&1; cp $O/$n.log /tmp/pilot/; cp /tmp/pilot/$n.json $O/ 2>/dev/null; }
case ${SET:-2} in
1)  # run 1 (session 6): 2-hop tables of 8 rows first; B-E crashed on 96-row tables > --seq 1024
run A --size small  --digits 2 --hops 2 --rows 8,24,40 --lr 2e-3 &
run B --size small  --digits 3 --hops 2 --rows 8,32,96 --lr 2e-3 &
run C --size small  --digits 4 --hops 2 --rows 8,32,96 --lr 2e-3 &
run D --size medium --digits 3 --hops 2 --rows 8,32,96 --lr 1e-3 &
run E --size small  --digits 3 --hops 2 --rows 8,32,96 --lr 4e-3 & ;;
2)  # run 2: denser look-up supervision (6 hops), smaller tables, lr sweep, smaller batches
run F --size small --digits 2 --hops 6 --rows 12,24,36 --lr 2e-3 --bs 16 &
run G --size small --digits 2 --hops 6 --rows 12,24,36 --lr 5e-3 --bs 16 &
run H --size small --digits 3 --hops 6 --rows 12,36,60 --lr 3e-3 --bs 16 &
run I --size small --digits 2 --hops 2 --rows 4,8,16   --lr 3e-3 --bs 16 & ;;
3)  # run 3: is it the plateau? the easiest tables, fixed size, 2 processes for the whole budget
run J --size small --digits 2 --hops 4 --rows 4 --lr 1e-3 --bs 16 --eval-s 30 &
run K --size small --digits 2 --hops 4 --rows 4 --lr 2e-3 --bs 16 --eval-s 30 & ;;
4)  # run 4: lr 1e-3 learned 4-row, 2-digit, 4-hop tables in ~400 steps (run 3); now lengthen, 3 digits
run M --size small --digits 3 --hops 4 --rows 4,16,48 --lr 1e-3 --bs 16 --eval-s 30 &
run N --size small --digits 3 --hops 4 --rows 8,24,64 --lr 1e-3 --bs 16 --eval-s 30 &
run O --size small --digits 2 --hops 4 --rows 4,16,40 --lr 1e-3 --bs 16 --eval-s 30 &
run P --size small --digits 3 --hops 4 --rows 4,16,48 --lr 5e-4 --bs 16 --eval-s 30 & ;;
esac
wait
tar czf $OUT/pilot.tgz -C $OUT pilot && rm -rf $O
for n in $(cd /tmp/pilot && ls *.log | sed s/.log//); do echo "== $n"; grep -v Warn /tmp/pilot/$n.log | tail -n 4 | cut -c1-400; done
