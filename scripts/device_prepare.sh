# Source this at the start of a command on the GPU machine (no network there):
#   source scripts/device_prepare.sh
# Installs the wheels carried in .whl/ (and .whl2/, .whl4/ where carried;
# scripts/fetch_device_wheels.sh fetches them) and makes the engines' CUDA extensions
# importable: from a build carried in .devcache/ when there is one, else compiled at first
# import (exllamav2: about 2 minutes; exllamav3: about 4.5) and, for exllamav2, copied to
# $OUT for next time.
wheels=$(ls .whl/*.whl .whl2/*.whl .whl4/*.whl 2>/dev/null)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $wheels || return 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/torch_ext
mkdir -p /tmp/ext_site
for ext in exllamav2_ext exllamav3_ext; do
    if ls .devcache/$ext.so.xz.part* >/dev/null 2>&1; then
        cat .devcache/$ext.so.xz.part* | xz -d > /tmp/ext_site/$ext.so
    fi
done
export PYTHONPATH="/tmp/ext_site:$PYTHONPATH"
start=$(date +%s)
python3 -c "import exllamav2, exllamav2.ext; print('exllamav2', exllamav2.__version__)" || return 1
echo "exllamav2 extension ready in $(( $(date +%s) - start ))s"
if [ -n "${OUT:-}" ] && ! ls .devcache/exllamav2_ext.so.xz.part* >/dev/null 2>&1; then
    built=$(find /tmp/torch_ext -name 'exllamav2_ext*.so' | head -1)
    if [ -n "$built" ]; then
        ls -la "$built"
        xz -T16 -6 -c "$built" | split -b 15M - "$OUT/exllamav2_ext.so.xz.part"
        ls -la "$OUT"
    fi
fi
