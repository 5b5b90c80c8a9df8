#!/usr/bin/env bash
# One call of the `device` tool (a lent GPU host): issue 44's GPU rows and the many-core shard scaling,
# as one prepared script (the lease is minutes; see /work/.library/device/METHOD.md in the workplace).
#
# Prepared here, on the developer's machine, by `bash bench/device_prep.sh` (the device host has no package
# registry and Python 3.12): .whl/ (cp312 wheels) and .devbuild/ (the native modules for Python 3.12, portable),
# and run as:  run(command="bash bench/device_check.sh", carry=[".whl", ".devbuild"], timeout_s=...)
# Environment: PARTS (default "server threads cuda pin"; "layouts" adds bench.layouts, the floor under the server's
# CPU over its kernel's on that host's memory), CONFIGS (default h1,defaults,auto,h4) and CUDA_ARGS
# (bench.cuda's), the parts' time limits: all of it about 7 minutes on the H200 host. Not yet run on a device: the
# threads part and h4 (written after the budget ran out).
# The shard part's workers send one message a round (the push carrying its pull, protocol 15, not yet run on a
# device); SERVER_EXTRA="--messages 1,2" SERVER_S=300 runs the two apart beside it, for what it saves 8 shards.
# Everything lands in $OUT (8 files at most come back): the logs, bench.server's and bench.cuda's --json, the
# machine's description, the profile.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheels did not install"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/client:$PWD/server:$PWD
cp .devbuild/_native.abi3.so client/stella/ && cp .devbuild/_kernel.abi3.so server/stella_ps/
{
  python3 -c "import sys, torch, stella, stella_ps._kernel as k, stella._native as n; \
print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
torch.cuda.get_device_name() if torch.cuda.is_available() else '-'); \
print('isa', n.ffi.string(n.lib.stella_native_isa()).decode() if hasattr(n.lib, 'stella_native_isa') else '?')"
  nproc; grep -m1 'model name' /proc/cpuinfo; free -g | head -2; uptime; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
} 2>&1 | tee "$OUT/machine.txt"

PARTS=${PARTS:-server threads cuda pin}  # which of the parts below run
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }

has server && {
say "bench.server: shards 1, 2, 4, 8 by one command, W = 8, 10M, AdamW, the kernel alone beside it"
timeout "${SERVER_S:-150}" python3 -m bench.server --one-host --workers 8 --shards 1,2,4,8 --optimizers adamw --kernel ${SERVER_EXTRA:-} \
  --json "$OUT/server.json" > "$OUT/server.log" 2>&1
say "bench.server rc $?"; grep -A6 '^tensors' "$OUT/server.log"
}

has cuda && {
say "bench.cuda: dense, ${CONFIGS:=h1,defaults,auto,h4}, 2 workers, 300 steps, ${CUDA_ARGS:=--flat --profile $OUT/profile.json}"
timeout "${CUDA_S:-330}" python3 -m bench.cuda --steps 300 --workers 2 --configs "$CONFIGS" \
  ${CUDA_ARGS:---flat --profile $OUT/profile.json} --json "$OUT/cuda.json" > "$OUT/cuda.log" 2>&1
say "bench.cuda rc $?"; tail -60 "$OUT/cuda.log"
}

has threads && {
say "bench.server: one shard, its step on 1, 4 and 8 threads (--threads: the apply, and the broadcast's pass in ranges)"
for th in 1 4 8; do
  timeout "${THREADS_S:-60}" python3 -m bench.server --workers 8 --shards 1 --optimizers adamw --steps 150 \
    --server-args "--threads $th" > "$OUT/t.log" 2>&1
  say "threads $th rc $?"; { echo "--threads $th"; cat "$OUT/t.log"; } >> "$OUT/server_threads.log"
  grep -A1 '^tensors' "$OUT/t.log" | tail -1; rm -f "$OUT/t.log"
done
}

if has pin && [ $(( $(date +%s) - t0 )) -lt "${MORE_BEFORE_S:-500}" ]; then
  say "bench.server: one shard pinned to a core, W = 2 and 32, 10M, AdamW: the server over its kernel with cores to spare"
  timeout "${MORE_S:-100}" python3 -m bench.server --pin --workers 2,32 --shards 1 --optimizers adamw --kernel \
    > "$OUT/server_pin.log" 2>&1
  say "bench.server rc $?"; grep -A4 '^tensors' "$OUT/server_pin.log"
fi
has layouts && {  # not in the default PARTS: the bench-only build compiles on first use (a C compiler, cffi)
say "bench.layouts: the memory a server step touches per pushed coordinate, today's layout and the fused record"
timeout "${LAYOUTS_S:-120}" python3 -m bench.layouts --json "$OUT/layouts.json" > "$OUT/layouts.log" 2>&1
say "bench.layouts rc $?"; tail -9 "$OUT/layouts.log"
}
say "done"
