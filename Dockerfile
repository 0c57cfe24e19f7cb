# syntax=docker/dockerfile:1
# gpuwatch's container image, for the DaemonSet in deploy/kubernetes/ (see its README.md).
#
#   docker build -t ghcr.io/gpuwatch/gpuwatch:0.1.0 .
#
# No NVIDIA library in the image: at run time the NVIDIA container toolkit mounts libnvidia-ml.so.1 and
# the /dev/nvidia* nodes into the container (runtimeClassName nvidia, NVIDIA_VISIBLE_DEVICES=all,
# NVIDIA_DRIVER_CAPABILITIES=utility), matching the node's driver. The DaemonSet runs it with a
# read-only root file system.

# -- builder: the gpuwatch wheel from this tree -------------------------------------------------
FROM python:3.12-slim AS builder
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gpuwatch ./gpuwatch
RUN pip wheel --no-cache-dir --no-deps -w /wheels .

# -- runtime: the wheel with the kubernetes extra (grpcio, protobuf: the kubelet's PodResources API) --
FROM python:3.12-slim
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="gpuwatch" \
      org.opencontainers.image.description="Per-node NVIDIA GPU monitor: NVML poller, anomaly rules and Prometheus exporter" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/gpuwatch/gpuwatch" \
      org.opencontainers.image.documentation="https://github.com/gpuwatch/gpuwatch/blob/main/deploy/kubernetes/README.md" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=builder /wheels /wheels
# pip compiles the .pyc files here, at build time: the root file system is read-only at run time.
RUN pip install --no-cache-dir --disable-pip-version-check "$(ls /wheels/*.whl)[kubernetes]" \
    && rm -rf /wheels
# Nothing to write at run time (read-only root file system); logs go to stderr unbuffered.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# UID 0 like the DaemonSet's runAsUser: the kubelet's pod-resources socket is root's (mode 0755), and
# connecting to it needs write permission. The DaemonSet drops every capability. Without the pod
# mapping, gpuwatch needs no root: USER 65534 here and runAsUser 65534 there (deploy/kubernetes/README.md).
USER 0
EXPOSE 19400
# No HEALTHCHECK: Kubernetes probes /healthz (livenessProbe, readinessProbe); `gpuwatch check` asks the
# daemon from a shell.
ENTRYPOINT ["gpuwatch"]
CMD ["run"]
