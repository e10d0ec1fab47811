# paramplane image for the docker compose demo. No registry or network is needed at build time:
# scripts/compose.sh builds the wheels on the host into .compose/wheels first, and the base image
# comes from PARAMPLANE_BASE_IMAGE (default python:3.12-slim; the script builds a local Debian one
# when that cannot be pulled).
ARG BASE=python:3.12-slim
FROM ${BASE}
ARG EXTRAS=""
ENV PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY .compose/wheels /wheels
RUN python3 -m venv /opt/paramplane \
 && /opt/paramplane/bin/pip install --no-index --find-links /wheels "paramplane${EXTRAS}" \
 && rm -rf /wheels
ENV PATH=/opt/paramplane/bin:$PATH
WORKDIR /app
COPY examples /app/examples
