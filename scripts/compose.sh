#!/usr/bin/env bash
# The docker compose demo, end to end, on a machine with no image registry:
#   scripts/compose.sh demo   build wheels, a token and (if needed) a local base image, then run the demo
#   scripts/compose.sh test   the same as a test: installs docker.io if missing (root), starts a daemon if none
#                             runs (and stops only that one), then runs the scenarios of scripts/compose_test.sh
#                             (an unbroken run; node-b killed and brought back; the coordinator killed; TLS)
#                             and removes every container, network and volume it made.
#   scripts/compose.sh bench  HybridShard step time over lanes, gRPC streams and gRPC streams + TLS
#                             (JSON lines in benchmarks/results/compose.jsonl).
#   scripts/compose.sh certs  only the CA and per-service certificates in .compose/tls (openssl).
#   scripts/compose.sh wheels [--gpu]   only the wheels in .compose/wheels (the images install from them);
#                             --gpu adds the gpu extra's (cupy and its needs) for docker-compose.gpu.yml.
# Environment: PARAMPLANE_BASE_IMAGE (default python:3.12-slim, else a Debian image built with debootstrap);
# TLS=1 adds docker-compose.tls.yml to demo (frames between hosts ride gRPC streams under TLS).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-demo}
case "$MODE" in
  demo|test|bench|certs|wheels) ;;
  *) echo "usage: scripts/compose.sh demo | test | bench | certs | wheels [--gpu]" >&2; exit 2 ;;
esac
PY=${PY:-python3}
PROJECT=${PARAMPLANE_COMPOSE_PROJECT:-paramplane-demo}
export COMPOSE_HTTP_TIMEOUT=${COMPOSE_HTTP_TIMEOUT:-300}  # a daemon on vfs can be slow to create containers
FILES=(-f docker-compose.yml)
[ "${TLS:-0}" = 1 ] && FILES+=(-f docker-compose.tls.yml)
STARTED_DAEMON=""
LOG=.compose/compose.log

say() { printf 'compose: %s\n' "$*" >&2; }

cleanup() {
  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    docker rm -f "${PROJECT}_checker" >/dev/null 2>&1 || true
    compose down -v --remove-orphans >/dev/null 2>&1 || true
  fi
  if [ -n "$STARTED_DAEMON" ]; then
    kill "$STARTED_DAEMON" 2>/dev/null || true
    wait "$STARTED_DAEMON" 2>/dev/null || true
  fi
}

compose() {
  if docker compose version >/dev/null 2>&1; then
    docker compose -p "$PROJECT" "${FILES[@]}" "$@"
  else
    docker-compose -p "$PROJECT" "${FILES[@]}" "$@"
  fi
}

ensure_docker() {
  if ! command -v docker >/dev/null 2>&1 || ! { docker compose version || command -v docker-compose; } >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || { say "SKIPPED: docker (with compose) is not installed and this is not root"; exit 0; }
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose debootstrap >/dev/null \
      || { say "SKIPPED: could not install docker.io"; exit 0; }
  fi
  if ! docker info >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || { say "SKIPPED: no docker daemon runs and this is not root"; exit 0; }
    dockerd --storage-driver=vfs --iptables=false >"$LOG.dockerd" 2>&1 &
    STARTED_DAEMON=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { say "SKIPPED: dockerd does not start in this environment (see $LOG.dockerd)"; exit 0; }
  fi
}

ensure_base() {
  BASE=${PARAMPLANE_BASE_IMAGE:-python:3.12-slim}
  if docker image inspect "$BASE" >/dev/null 2>&1 || docker pull -q "$BASE" >/dev/null 2>&1; then
    export PARAMPLANE_BASE_IMAGE=$BASE
    return
  fi
  BASE=paramplane-base:bookworm
  if ! docker image inspect "$BASE" >/dev/null 2>&1; then
    say "no registry: building $BASE from Debian packages (debootstrap; once)"
    root=$(mktemp -d)
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip bookworm "$root" >"$LOG.debootstrap" 2>&1
    tar -C "$root" -c . | docker import - "$BASE" >/dev/null
    rm -rf "$root"
  fi
  export PARAMPLANE_BASE_IMAGE=$BASE
}

wheels() {
  # Wheels for the image's Python: the debootstrap base has the same minor version as this machine's python3.
  rm -rf .compose/wheels
  $PY -m pip wheel -q -w .compose/wheels . >"$LOG.wheels" 2>&1 || { tail -20 "$LOG.wheels" >&2; exit 1; }
  if [ "${1:-}" = "--gpu" ]; then
    $PY -m pip download -q --only-binary=:all: -d .compose/wheels 'cupy-cuda12x>=13' >>"$LOG.wheels" 2>&1 \
      || { tail -20 "$LOG.wheels" >&2; exit 1; }
  fi
}

certs() {
  # A CA, and for each service a key and a certificate for its compose name (the coordinator's also for
  # 127.0.0.1 and localhost: its healthcheck and `paramplane status` inside the container dial those).
  local dir=${PARAMPLANE_TLS_DIR:-.compose/tls}  # docker-compose.tls.yml mounts .compose/tls
  [ -s "$dir/node-b.pem" ] && return
  command -v openssl >/dev/null || { say "FAILED: TLS needs openssl"; exit 1; }
  mkdir -p "$dir"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 30 -subj "/CN=paramplane demo CA" \
    -keyout "$dir/ca.key" -out "$dir/ca.pem" 2>/dev/null
  for svc in coordinator node-a node-b; do
    local san="DNS:$svc"
    [ "$svc" = coordinator ] && san="$san,DNS:localhost,IP:127.0.0.1"
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=$svc" -keyout "$dir/$svc.key" -out "$dir/$svc.csr" 2>/dev/null
    printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' "$san" >"$dir/$svc.ext"
    openssl x509 -req -in "$dir/$svc.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial -days 30 \
      -extfile "$dir/$svc.ext" -out "$dir/$svc.pem" 2>/dev/null
    rm -f "$dir/$svc.csr" "$dir/$svc.ext"
  done
  chmod 600 "$dir"/*.key
}

token() {
  [ -s .compose/token ] || { $PY -c 'import secrets; print(secrets.token_hex(16))' > .compose/token; chmod 600 .compose/token; }
}

mkdir -p .compose
if [ "$MODE" = wheels ]; then
  wheels "${2:-}"
  say "wheels in .compose/wheels: $(ls .compose/wheels | wc -l) files"
  exit 0
fi
if [ "$MODE" = certs ]; then
  certs
  say "certificates in ${PARAMPLANE_TLS_DIR:-.compose/tls}"
  exit 0
fi
trap cleanup EXIT
ensure_docker
ensure_base
token
[ "${TLS:-0}" = 1 ] && certs
say "base image: $PARAMPLANE_BASE_IMAGE"
if [ "${PARAMPLANE_COMPOSE_REUSE_IMAGE:-0}" = 1 ] && docker image inspect paramplane:local >/dev/null 2>&1; then
  say "reusing the image paramplane:local (PARAMPLANE_COMPOSE_REUSE_IMAGE=1): examples/ and the package as built before"
  : >"$LOG"
else
  wheels
  previous=$(docker image inspect -f '{{.Id}}' paramplane:local 2>/dev/null || true)
  compose build >"$LOG" 2>&1 || { tail -40 "$LOG" >&2; exit 1; }
  # The image this build replaced is untagged now: remove it (under vfs each one is a full copy of its layers,
  # and repeated runs filled the disk), unless a container still uses it.
  if [ -n "$previous" ] && [ "$previous" != "$(docker image inspect -f '{{.Id}}' paramplane:local 2>/dev/null)" ]; then
    docker rmi "$previous" >/dev/null 2>&1 || true
  fi
fi
if [ "$MODE" != demo ]; then
  # shellcheck source=scripts/compose_test.sh
  . scripts/compose_test.sh
  "compose_$MODE"
  exit $?
fi
# The coordinator first (compose v1 may otherwise recreate it while the nodes start), then the nodes,
# detached: a node killed meanwhile (`docker kill paramplane-demo_node-b_1`) must not stop the demo.
compose up -d coordinator >>"$LOG" 2>&1 || { tail -30 "$LOG" >&2; exit 1; }
view=$(compose port coordinator 8080 2>/dev/null | tail -1 || true)
[ -z "$view" ] || say "live view: http://$view/?token=<the token in .compose/token> (also /metrics, /api/status)"
compose up -d --no-recreate node-a node-b >>"$LOG" 2>&1 || { tail -30 "$LOG" >&2; exit 1; }
compose logs -f node-a node-b &
FOLLOW=$!
code=0
end=$((SECONDS + ${PARAMPLANE_DEMO_LIMIT_S:-3600}))
for svc in node-a node-b; do
  # each node ends with its last status; a crashed one is restarted by its restart policy meanwhile
  until [ "$(docker inspect -f '{{.State.Status}}' "$(compose ps -q $svc)")" = exited ]; do
    [ "$SECONDS" -lt "$end" ] || { say "the demo ran past PARAMPLANE_DEMO_LIMIT_S"; code=1; break; }
    sleep 1
  done
  [ "$(docker inspect -f '{{.State.ExitCode}}' "$(compose ps -q $svc)")" = 0 ] || code=1
done
kill "$FOLLOW" 2>/dev/null || true
exit $code
