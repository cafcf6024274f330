# CPU image of specserve (the GPU image arrives with the deployment work).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    SPECSERVE_CACHE=/models

WORKDIR /app
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY server ./server
COPY configs ./configs
RUN pip install . \
    && useradd --create-home --uid 1000 specserve \
    && mkdir -p /models && chown specserve /models

USER specserve
VOLUME ["/models"]
ENTRYPOINT ["specserve"]
CMD ["generate", "--config", "configs/smollm2-cpu.yaml"]
