# One image for the operator (`tensile operator`), the node agent (`tensile agent`) and the hook's init
# container in training pods (`python -m tensile_hook.install /tensile`).
# Build: docker build -t ghcr.io/tensile/tensile:0.1.0 .
# tests/deploy/test_dockerfile.py checks the copied paths, the entrypoints and that the pins below match
# pyproject.toml and constraints.txt.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- builder: resolve and install every wheel into a virtual environment -------------------------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ONLY_BINARY=:all: \
    PIP_NO_BINARY=tensile
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

# Dependencies first (a layer that survives source edits). Torch is the CPU build: in this image it
# only traces models for forecasts, on the meta device; training pods bring their own CUDA torch.
COPY pyproject.toml constraints.txt README.md ./
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu -c constraints.txt \
        torch==2.13.0+cpu torchvision==0.28.0+cpu

COPY tensile ./tensile
COPY operator ./operator
COPY node_agent ./node_agent
COPY runtime_hook ./runtime_hook
# A regular (not editable) install: the runtime stage needs only /opt/venv, not /src.
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu -c constraints.txt ".[zoo,operator,agent]" \
    && pip check \
    && python -c "import tensile_operator.main, tensile_agent.server, tensile_hook.install"

# ---- runtime: the interpreter, the venv and a non-root user; no compilers, no pip cache ----------
FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 tensile \
    && useradd --system --uid 10001 --gid tensile --create-home --home-dir /home/tensile \
       --shell /usr/sbin/nologin tensile
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    MPLCONFIGDIR=/tmp/matplotlib
USER 10001:10001
WORKDIR /home/tensile
# The operator's liveness and metrics, the agent, the webhook.
EXPOSE 8080 8081 8470 9443
ENTRYPOINT ["tensile"]
CMD ["--help"]
