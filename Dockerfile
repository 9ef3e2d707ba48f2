# The cdc-relay image.
#
#   make dist && docker build -t cdc-relay .
#   docker run --rm -e CDC_RELAY_DSN='host=db dbname=shop user=relay' -e PGPASSWORD \
#       -e CDC_RELAY_KAFKA_BOOTSTRAP=kafka:9092 -p 9464:9464 cdc-relay          # cdc-relay stream
#   docker run --rm -e CDC_RELAY_DSN=... -e PGPASSWORD cdc-relay setup-slot    # any other command
#
# Two stages on the same base. `build` takes the wheel `make dist` built (the one a release
# publishes, its version from git) and adds the wheels of its dependencies, which PyPI serves
# prebuilt (manylinux), so no compiler is needed even there.
# The final stage installs those wheels from a bind mount, offline, and so keeps neither the
# wheels, nor pip's cache, nor the sources; it has no compiler and no package-manager lists.
# RUN --mount needs BuildKit, the default builder since Docker 23 (and always docker compose's).
#
# The base is a pinned minor version of Python on Debian 12. For reproducible production
# images, pin it by digest as well: --build-arg PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:...
# checkov:skip=CKV_DOCKER_7: both stages use this ARG, whose default is a pinned tag; checkov does not resolve ARGs (tests/deploy checks the default)
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY dist/ ./dist/
RUN python -m pip wheel --wheel-dir /wheels ./dist/cdc_relay-*.whl

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="cdc-relay" \
      org.opencontainers.image.description="Transactional-outbox events from PostgreSQL to Kafka through logical replication" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    CDC_RELAY_METRICS_PORT=9464
# Only cdc-relay's own wheel is named; its dependencies come from the same folder, pinned by
# what the build stage resolved. A fixed numeric UID/GID lets Kubernetes check runAsNonRoot
# and lets volumes be prepared for it.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m pip install --no-index --find-links=/wheels /wheels/cdc_relay-*.whl \
    && groupadd --system --gid 10001 cdc-relay \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin cdc-relay
USER 10001:10001
WORKDIR /tmp
# /metrics, /healthz and /readyz of `cdc-relay stream` and `cdc-relay poll`.
EXPOSE 9464
# For docker and docker compose; Kubernetes uses the probes in deploy/ instead. Passes when the
# metrics port is turned off (CDC_RELAY_METRICS_PORT=0): there is nothing to ask then.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; port = os.environ.get('CDC_RELAY_METRICS_PORT', '0'); sys.exit(port != '0' and urllib.request.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=4).status != 200)"]
ENTRYPOINT ["cdc-relay"]
CMD ["stream"]
