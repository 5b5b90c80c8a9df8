# stella-ps: the parameter server. CPU only, no torch, non-root, checkpoints on a volume.
#
#   make wheelhouse
#   docker build -f docker/server.Dockerfile -t stella-ps:0.1.0 docker/
#   docker image prune -f --filter label=org.stella.stage=build   # the build stage, left dangling
#
# Installs only from the wheelhouse in the build context (docker/wheelhouse, made by
# `make wheelhouse`): no package index is needed inside the build. BASE_IMAGE must have
# python3 with venv and the wheelhouse's Python version (3.11); without a registry, make
# one with docker/make-base-image.sh and pass --build-arg BASE_IMAGE=stella-base:bookworm.
# No `# syntax=` line on purpose: it would make BuildKit pull a frontend image.
ARG BASE_IMAGE=python:3.11.10-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG STELLA_VERSION=0.1.0
# the legacy builder keeps this stage as a dangling image (wheelhouse and venv, hundreds
# of MB): the label lets `docker image prune --filter` find it (make docker-images does)
LABEL org.stella.stage=build
COPY wheelhouse /wheelhouse
RUN python3 -m venv /opt/stella \
 && /opt/stella/bin/pip install --no-cache-dir --no-index --find-links /wheelhouse "stella==${STELLA_VERSION}" \
 && /opt/stella/bin/pip uninstall -y pip \
 && /opt/stella/bin/python -c "import stella_ps.kernel, stella_ps.metrics" \
 && ! /opt/stella/bin/python -c "import torch" 2>/dev/null

FROM ${BASE_IMAGE}
ARG STELLA_UID=10001
LABEL org.opencontainers.image.title="stella-ps" \
      org.opencontainers.image.description="Stella parameter server (CPU only)" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid ${STELLA_UID} stella \
 && useradd --system --uid ${STELLA_UID} --gid stella --home-dir /var/lib/stella --shell /usr/sbin/nologin stella \
 && mkdir -p /var/lib/stella/checkpoints \
 && chown -R stella:stella /var/lib/stella
COPY --from=build /opt/stella /opt/stella
# keys from a directory mounted at /etc/stella/keys (the allowlist is re-read when it
# changes there); checkpoints on the volume, resumed from on start (STELLA_PS_CHECKPOINT_DIR=
# empty turns them off). Only what the image sets differently from the server's defaults:
# it keeps the others (the workers' port 5555 and JSON logs among them).
ENV PATH=/opt/stella/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    STELLA_PS_METRICS=0.0.0.0:9100 \
    STELLA_PS_KEYS=/etc/stella/keys/server.key_secret \
    STELLA_PS_ALLOW=/etc/stella/keys/allowlist \
    STELLA_PS_CHECKPOINT_DIR=/var/lib/stella/checkpoints
VOLUME ["/var/lib/stella/checkpoints"]
WORKDIR /var/lib/stella
EXPOSE 5555 9100
USER stella
# asks the server itself: /healthz is answered by the daemon's own event loop
HEALTHCHECK --interval=10s --timeout=5s --start-period=15s --retries=3 CMD ["stella-ps-health", "--quiet"]
ENTRYPOINT ["stella-ps"]
