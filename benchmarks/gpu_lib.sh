# Sourced by the device-call scripts (benchmarks/gpu_session29.sh ...): the call's environment, the GPU's name and
# memory ($mem, MiB, written to $OUT/gpu.txt), and the ncu step they share.
set -u
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
TOTAL=${TOTAL:-520}
SRL="python3 -m sparse_rl.cli.main"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)

ncu_tiles() {  # $1 seconds, $2 report name: the tile forward / dq and dk/dv kernels of gpu_ncu_session30.py by counters
  timeout "$1" ncu --clock-control none --profile-from-start off -k regex:'_tile_(fwd|dq)|_kq_dkdv' \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis -o "$OUT/$2" python3 benchmarks/gpu_ncu_session30.py > "$OUT/$2.log" 2>&1
  echo "ncu rc=$? at ${SECONDS}s"; tail -3 "$OUT/$2.log"
  ncu --import "$OUT/$2.ncu-rep" --page details > "$OUT/$2.txt" 2>&1
  keep="^  _|Duration|Registers Per|Achieved Occupancy|Eligible Warps|Issued Warp|No Eligible|L2 Hit"
  grep -E "$keep|Memory Throughput|DRAM Throughput|Compute \(SM\)|Stall|Block Limit" "$OUT/$2.txt" | head -150
}
