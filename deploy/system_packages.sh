#!/usr/bin/env bash
# Debian packages the test suite runs for real: etcd (controller leader election) and promtool
# (the Prometheus alert rules are checked and unit-tested). Installed once; a second run only
# checks that the binaries are there. Needs root (or sudo) and apt on a machine without them.
set -euo pipefail
needed=()
command -v etcd >/dev/null || needed+=(etcd-server)
command -v etcdctl >/dev/null || needed+=(etcd-client)
command -v promtool >/dev/null || needed+=(prometheus)
[ ${#needed[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
# The package lists may be missing on a fresh machine: update only when the install fails.
if ! $SUDO apt-get install -y -q --no-install-recommends "${needed[@]}" >/dev/null; then
    $SUDO apt-get update -q >/dev/null
    $SUDO apt-get install -y -q --no-install-recommends "${needed[@]}" >/dev/null
fi
# The prometheus package enables a server unit; the suite only needs promtool.
command -v etcd >/dev/null && command -v promtool >/dev/null
