#!/usr/bin/env bash
# The docker compose demo, end to end, on a machine with no image registry:
#   scripts/compose.sh demo   build wheels, a token and (if needed) a local base image, then run the demo
#   scripts/compose.sh test   the same as a test: installs docker.io if missing (root), starts a daemon if none
#                             runs (and stops only that one), asserts the training result and the checkpoint,
#                             and removes every container, network and volume it made.
#   scripts/compose.sh wheels [--gpu]   only the wheels in .compose/wheels (the images install from them);
#                             --gpu adds the gpu extra's (cupy and its needs) for docker-compose.gpu.yml.
# Environment: PARAMPLANE_BASE_IMAGE (default python:3.12-slim, else a Debian image built with debootstrap).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-demo}
case "$MODE" in
  demo|test|wheels) ;;
  *) echo "usage: scripts/compose.sh demo | test | wheels [--gpu]" >&2; exit 2 ;;
esac
PY=${PY:-python3}
PROJECT=paramplane-demo
STARTED_DAEMON=""
LOG=.compose/compose.log

say() { printf 'compose: %s\n' "$*" >&2; }

cleanup() {
  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    compose down -v --remove-orphans >/dev/null 2>&1 || true
  fi
  if [ -n "$STARTED_DAEMON" ]; then
    kill "$STARTED_DAEMON" 2>/dev/null || true
    wait "$STARTED_DAEMON" 2>/dev/null || true
  fi
}

compose() {
  if docker compose version >/dev/null 2>&1; then
    docker compose -p "$PROJECT" "$@"
  else
    docker-compose -p "$PROJECT" "$@"
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

prepare() {
  [ -s .compose/token ] || { $PY -c 'import secrets; print(secrets.token_hex(16))' > .compose/token; chmod 600 .compose/token; }
  wheels
}

mkdir -p .compose
if [ "$MODE" = wheels ]; then
  wheels "${2:-}"
  say "wheels in .compose/wheels: $(ls .compose/wheels | wc -l) files"
  exit 0
fi
trap cleanup EXIT
ensure_docker
ensure_base
prepare
say "base image: $PARAMPLANE_BASE_IMAGE"
compose build >"$LOG" 2>&1 || { tail -40 "$LOG" >&2; exit 1; }
# The coordinator first (compose v1 may otherwise recreate it while the nodes start), then the nodes.
compose up -d coordinator >>"$LOG" 2>&1 || { tail -30 "$LOG" >&2; exit 1; }
view=$(compose port coordinator 8080 2>/dev/null | tail -1 || true)
[ -z "$view" ] || say "live view: http://$view/?token=<the token in .compose/token> (also /metrics, /api/status)"
if [ "$MODE" = demo ]; then
  compose up --no-recreate --abort-on-container-exit --exit-code-from node-a node-a node-b
  exit $?
fi
compose up --no-recreate --abort-on-container-exit --exit-code-from node-a node-a node-b >>"$LOG" 2>&1 \
  || { tail -60 "$LOG" >&2; exit 1; }
compose logs node-a node-b >"$LOG.nodes" 2>&1
grep -q "hosts 2, ranks 4, shard group 2" "$LOG.nodes" || { say "FAILED: the world was not 2 hosts x 2 ranks"; tail -40 "$LOG.nodes" >&2; exit 1; }
acc=$(grep -o 'accuracy: [0-9.]*' "$LOG.nodes" | tail -1 | cut -d' ' -f2)
$PY -c "import sys; sys.exit(0 if float('${acc:-0}') > 0.9 else 1)" || { say "FAILED: accuracy ${acc:-none}"; exit 1; }
compose run --rm --no-deps --entrypoint sh node-a -c 'test -f /ckpt/step_60/manifest.json' \
  || { say "FAILED: no committed checkpoint in the volume"; exit 1; }
say "PASSED: 2 hosts x 2 ranks trained (accuracy $acc), checkpoint committed in the volume"
