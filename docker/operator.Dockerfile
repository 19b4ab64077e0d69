# syntax=docker/dockerfile:1
# The operator image: `kvpilot operator` (kopf), slim Python, no torch.
# Built by `make images`; pin the base by digest for a release:
#   docker build --build-arg PYTHON_IMAGE=docker.io/library/python:3.12.11-slim-bookworm@sha256:... -f docker/operator.Dockerfile .
ARG PYTHON_IMAGE=docker.io/library/python:3.12.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/kvpilot
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime ./runtime
COPY kernels ./kernels
COPY operator ./operator
COPY bench ./bench
RUN /opt/kvpilot/bin/pip install ".[operator]" \
 && /opt/kvpilot/bin/pip uninstall --yes pip

FROM ${PYTHON_IMAGE}
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kvpilot
COPY --from=build /opt/kvpilot /opt/kvpilot
ENV PATH=/opt/kvpilot/bin:$PATH \
    PYTHONUNBUFFERED=1
USER 1000:1000
# /metrics and kopf's /healthz (the chart's metrics.port and health.port)
EXPOSE 8080 8081
ENTRYPOINT ["kvpilot"]
CMD ["operator", "--all-namespaces"]
