# Sourced by the device scripts that use the CPU llama-server carried in .devcpu/ (cpu-up.sh, cpu-early.sh):
# the bundle on PYTHONPATH, the server unpacked to /root/bin and set as LLAMA_SERVER, bytecode compiled,
# O=${OUT:-/tmp}/$1 made, and log() for timestamps.   source scripts/device/cpu-setup.sh NAME
source .devbundle/on-device.sh .devbundle >/dev/null
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 ORCHESTRATOR_CACHE=/root/.cache/orchestrator
O=${OUT:-/tmp}/$1
mkdir -p "$O" models /root/bin
t0=$(date +%s); log() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
xz -dc .devcpu/llama-server.xz > /root/bin/llama-server && chmod +x /root/bin/llama-server
export LLAMA_SERVER=/root/bin/llama-server
( time python3 -m compileall -q -j 16 /tmp/site "$PWD/orchestrator" ) > "$O/compileall.log" 2>&1; log "bytecode"
