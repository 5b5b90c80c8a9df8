# A Stella worker: the client library (stella[worker]) on a PyTorch base.
#
#   make wheelhouse
#   docker build -f docker/worker.Dockerfile -t stella-worker:0.1.0 docker/            # CUDA base
#   docker build -f docker/worker.Dockerfile -t stella-worker:0.1.0-cpu \
#       --build-arg BASE_IMAGE=stella-base:bookworm docker/                            # CPU, for tests
#   docker image prune -f --filter label=org.stella.stage=build     # the build stage, left dangling
#
# A torch already in the base image (the CUDA build of pytorch/pytorch) is kept, as
# `make install` keeps one; otherwise the CPU torch wheel comes from the wheelhouse.
# The base's Python must match the wheelhouse's (3.11, as the pinned default has).
# The entrypoint shapes the container's link when STELLA_SHAPE_RATE is set (needs
# NET_ADMIN), then runs the command as the unprivileged user `stella`.
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

FROM ${BASE_IMAGE} AS build
ARG STELLA_VERSION=0.1.0
ARG EXTRAS=worker,demo
# found by `docker image prune -f --filter label=org.stella.stage=build` (server.Dockerfile)
LABEL org.stella.stage=build
COPY wheelhouse /wheelhouse
RUN python3 -m venv --system-site-packages /opt/stella \
 && /opt/stella/bin/pip install --no-cache-dir --no-index --find-links /wheelhouse \
        "stella[${EXTRAS}]==${STELLA_VERSION}" \
 && /opt/stella/bin/python -c "import torch, stella.pipeline; print('torch', torch.__version__)"

FROM ${BASE_IMAGE}
ARG STELLA_UID=10001
LABEL org.opencontainers.image.title="stella-worker" \
      org.opencontainers.image.description="Stella worker: the client library on PyTorch" \
      org.opencontainers.image.licenses="Apache-2.0"
# tc (iproute2) for the lab's shaped links; setpriv (util-linux) to drop root after shaping
RUN (command -v tc >/dev/null && command -v setpriv >/dev/null) || \
    (apt-get update && apt-get install -y --no-install-recommends iproute2 util-linux \
     && rm -rf /var/lib/apt/lists/*) \
 && groupadd --system --gid ${STELLA_UID} stella \
 && useradd --system --uid ${STELLA_UID} --gid stella --create-home --home-dir /home/stella \
        --shell /usr/sbin/nologin stella
COPY --from=build /opt/stella /opt/stella
COPY worker-entrypoint.sh /usr/local/bin/stella-worker-entrypoint
ENV PATH=/opt/stella/bin:$PATH \
    PYTHONUNBUFFERED=1
WORKDIR /home/stella
ENTRYPOINT ["stella-worker-entrypoint"]
CMD ["stella", "demo", "--help"]
