# The metering service. `docker compose up` runs it with PostgreSQL and Grafana
# (docs/operator/deployment.md); alone: docker build -t metering . && docker run -p 8080:8080 \
#   -e METERING_DATABASE_URL=postgresql://... -e METERING_ADMIN_KEY=... metering
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# The locked runtime dependencies and build backend first (requirements.lock: exact versions,
# every file checked against its hash; a layer that outlives code changes), then the package the
# way any install does, `pip install .` (the package, its migrations and the dashboard's
# static files), alone: built by the locked setuptools, nothing resolved, nothing fetched.
WORKDIR /src
COPY requirements.lock ./
RUN pip install --require-hashes -r requirements.lock
COPY pyproject.toml README.md LICENSE ./
COPY metering ./metering
COPY migrations ./migrations
RUN pip install --no-deps --no-build-isolation . && rm -rf /src

RUN useradd --system --uid 10001 --create-home --home-dir /app metering
WORKDIR /app
USER metering

EXPOSE 8080
# `metering serve` applies pending migrations first (under an advisory lock on PostgreSQL, so
# replicas may start together), then serves. Health: GET /readyz (the database is reachable).
CMD ["metering", "serve", "--host", "0.0.0.0", "--port", "8080"]
