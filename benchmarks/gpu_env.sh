# Sourced (`. benchmarks/gpu_env.sh`) at the start of a device command (benchmarks/README.md), from the repo root on
# the device machine: installs the carried wheels (.whl/: fla-core and pydantic, which the GPU image lacks) into
# /tmp/site, sets the environment (compiled Triton, not the interpreter tests/conftest.py defaults to; fla's
# autotune cache from .fla_cache/ when carried) and defines `step CAP NAME CMD...`: run CMD under a time cap,
# logging to $OUT/NAME.log and printing its tail.
out=${OUT:-gpu_logs}; mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
fi
export PYTHONPATH=/tmp/site:$PWD TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
# Triton keeps autotune results in its cache dir (and reads them back): fla's, carried in .fla_cache, are not paid again
export TRITON_CACHE_AUTOTUNING=1
mkdir -p /tmp/tc
if [ -f .fla_cache/fla_autotune.tgz ]; then tar -xzf .fla_cache/fla_autotune.tgz -C /tmp/tc; fi
step() { local cap=$1 name=$2; shift 2; echo "== $name (cap ${cap}s)"; timeout "$cap" "$@" 2>&1 | tee "$out/$name.log" | tail -40; }
