#!/usr/bin/env bash
# Installs what the tests' real services need, from Debian's packages, when missing:
# PostgreSQL (the shared-study test starts its own server on a free loopback port and stops it)
# and headless Chromium + ChromeDriver (the report test). Quick when everything is there.
set -euo pipefail
need=()
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "tests/ensure_services.sh: missing ${need[*]}; install them (Debian: apt-get install ${need[*]})" >&2
    exit 0   # the tests that need them then skip (or fail under CI), saying why
fi
echo "installing ${need[*]} (Debian packages) for the tests" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# The Debian package may start a cluster of its own; the tests use their own server.
if command -v pg_lsclusters >/dev/null 2>&1; then
    pg_lsclusters -h 2>/dev/null | while read -r ver name _; do
        pg_ctlcluster "$ver" "$name" stop 2>/dev/null || true
    done || true
fi
exit 0
