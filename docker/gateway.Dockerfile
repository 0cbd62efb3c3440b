# The gateway image: no torch, no model — only the HTTP front and its state client.
# Build from the repository root:  docker build -f docker/gateway.Dockerfile -t switchyard-gateway .
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY policies ./policies
COPY cache ./cache
COPY backends/__init__.py ./backends/__init__.py
RUN pip install --no-cache-dir . && useradd --system --uid 10001 switchyard
USER switchyard
EXPOSE 8443
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
  CMD python -c "import ssl,urllib.request,sys; c=ssl._create_unverified_context(); urllib.request.urlopen('https://127.0.0.1:8443/health', context=c, timeout=2)" || exit 1
ENTRYPOINT ["switchyard"]
CMD ["gateway", "--config", "/etc/switchyard/gateway.yaml"]
