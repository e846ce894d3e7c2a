#!/usr/bin/env bash
# vLLM 0.24.0's Python files and the extra packages its loaders import, for the CPU checks against vLLM's real code
# (benchmarks/probe_vllm_reload_cpu.py, tests/rollout/test_vllm_cpu_probe.py). No CUDA library is kept or loaded:
# the wheel's .so files are left out. Prints the path list for CALCLIP_VLLM_CPU_SITE on its last line.
#   bash benchmarks/vllm_cpu_site.sh DIR
set -euo pipefail
dir=$(mkdir -p "${1:?usage: vllm_cpu_site.sh DIR}" && cd "$1" && pwd)
if [ ! -d "$dir/site/vllm" ]; then
  python -m pip download -q --no-deps --dest "$dir/wheel" "vllm==0.24.0"
  python - "$dir" <<'PY'
import pathlib, sys, zipfile
root = pathlib.Path(sys.argv[1])
wheel, = (root / "wheel").glob("vllm-0.24.0-*.whl")
with zipfile.ZipFile(wheel) as archive:
    archive.extractall(root / "site", [name for name in archive.namelist() if not name.endswith(".so")])
PY
  rm -rf "$dir/wheel"
fi
# What `import vllm.engine.arg_utils` and the compressed-tensors / FP8 loaders need beyond calclip's environment,
# at the versions the checks were run with (compressed-tensors is the one vLLM 0.24.0 pins); and what vLLM's
# scheduler imports (its structured-output manager: llguidance, xgrammar + apache-tvm-ffi, the versions the GPU
# bundle ships) for benchmarks/probe_vllm_host_cpu.py.
[ -d "$dir/deps/compressed_tensors" ] || python -m pip install -q --no-deps --target "$dir/deps" \
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 attrs==26.1.0 cachetools==8.0.2 cbor2==6.3.0 \
  cloudpickle==3.1.3 compressed-tensors==0.17.0 frozenlist==1.8.0 loguru==0.7.3 msgspec==0.23.0 multidict==7.2.1 \
  openai==3.63.0 openai-harmony==0.0.8 prometheus-client==0.26.0 propcache==0.5.4 pybase64==1.5.1 pyzmq==27.3.0 \
  uvloop==0.23.0 yarl==1.25.1
[ -d "$dir/deps/xgrammar" ] || python -m pip install -q --no-deps --target "$dir/deps" \
  llguidance==1.7.6 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
# vLLM's attention package imports einops (vit_attn_wrappers); CI's environment has it through DeepSpeed, a bare one
# does not.
[ -d "$dir/deps/einops" ] || python -m pip install -q --no-deps --target "$dir/deps" einops==0.8.2
echo "$dir/site:$dir/deps"
