#!/usr/bin/env bash
# The test suite under Python 3.13 (Debian trixie's python3) in a chroot: proves the upper end of the declared
# Python range, as CI's python3.11 proves the lower one. `make test-py313`; `.ci/run` runs it as root.
#
# Builds a trixie root file system with debootstrap once (PARAMPLANE_PY313_ROOT, default
# /var/tmp/paramplane-trixie), downloads the dependency wheels for cp313 here (the chroot installs with
# --no-index from them), copies the tracked source tree in, installs it there as `make install` does
# (editable, dev and demo extras) and runs pytest. Tests that need host tools absent from the chroot (iproute2's ip netns, docker) skip themselves;
# torch is not installed there, so its cross-checks skip too. Mounts /proc, /dev and /dev/shm into the chroot
# and unmounts them on exit. Exits 0 with SKIPPED where it cannot run (not root, no debootstrap to install).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ROOT=${PARAMPLANE_PY313_ROOT:-/var/tmp/paramplane-trixie}
say() { echo "test-py313: $*"; }

if [ "$(id -u)" != 0 ]; then
  say "SKIPPED (needs root for debootstrap and chroot)"
  exit 0
fi
if ! command -v debootstrap >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null \
    || { say "SKIPPED (debootstrap cannot be installed)"; exit 0; }
fi
if [ ! -x "$ROOT/usr/bin/python3.13" ]; then
  say "building a Debian trixie root with python3.13 in $ROOT (debootstrap; once)"
  rm -rf "$ROOT"
  debootstrap --variant=minbase --include=python3,python3-venv trixie "$ROOT" http://deb.debian.org/debian \
    >/tmp/paramplane-py313-debootstrap.log 2>&1 || { tail -20 /tmp/paramplane-py313-debootstrap.log >&2; exit 1; }
fi

mounted=()
cleanup() {
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[$i]}" 2>/dev/null || true; done
}
trap cleanup EXIT
for m in proc dev dev/shm; do
  mkdir -p "$ROOT/$m"
  if [ "$m" = proc ]; then mount -t proc proc "$ROOT/proc"; else mount --bind "/$m" "$ROOT/$m"; fi
  mounted+=("$ROOT/$m")
done

rm -rf "$ROOT/wheels" "$ROOT/src" "$ROOT/venv"
mkdir -p "$ROOT/wheels" "$ROOT/src"
say "wheels for cp313"
deps=$($PY - <<'EOF'
import tomllib
meta = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = meta["optional-dependencies"]
print("\n".join([*meta["dependencies"], *extras["dev"], *extras["demo"], "setuptools>=68", "wheel"]))
EOF
)
mapfile -t deps <<<"$deps"
$PY -m pip download -q -d "$ROOT/wheels" --only-binary=:all: --python-version 3.13 --implementation cp \
  --abi cp313 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  "${deps[@]}" 2>/dev/null
git ls-files -z | tar --null -T - -c | tar -x -C "$ROOT/src"

say "installing and running the suite under $(chroot "$ROOT" python3 --version)"
chroot "$ROOT" /usr/bin/env -i PATH=/venv/bin:/usr/bin:/bin HOME=/root PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels \
  PIP_DISABLE_PIP_VERSION_CHECK=1 /bin/sh -c '
    set -e
    python3 -m venv /venv
    pip install -q -e "/src[dev,demo]"
    cd /src && python -c "import sys; assert sys.version_info[:2] == (3, 13), sys.version"
    python -m pytest -q -p no:cacheprovider -ra
  '
say "PASSED under Python 3.13"
