#!/usr/bin/env bash
# Build the Shortlist image on a machine without a registry, from a bare host:
#   docker/build.sh [cpu|cuda]        (env: TAG, BASE, BASE_TARBALL_CACHE)
# 1. a Docker engine: uses the one that answers, else starts dockerd (Debian's docker.io,
#    installed with apt when missing), logging to $STATE/dockerd.log;
# 2. a base image: BASE if set (e.g. python:3.11-slim where a registry is reachable), else
#    local/debian:bookworm, made once with debootstrap from the host's apt mirror and trusting
#    the host's CA certificates (pip in the build goes through the host's proxy);
# 3. docker build --network host (the default bridge has no NAT on these machines).
# Every command that changes the host is printed before it runs.
set -euo pipefail
cd "$(dirname "$0")/.."
VARIANT=${1:-cpu}
STATE=${SL_DOCKER_STATE:-/var/tmp/shortlist-docker}
LOCAL_BASE=local/debian:bookworm
mkdir -p "$STATE"

run() { echo "+ $*" >&2; "$@"; }

ensure_engine() {
  if docker info >/dev/null 2>&1; then return; fi
  if ! command -v dockerd >/dev/null; then
    echo "no Docker engine: installing Debian's docker.io" >&2
    run apt-get update -qq
    run apt-get install -y -qq --no-install-recommends docker.io debootstrap
  fi
  echo "no Docker engine answers: starting dockerd (log: $STATE/dockerd.log)" >&2
  echo "+ dockerd --iptables=false --storage-driver overlay2 &" >&2
  nohup dockerd --iptables=false --storage-driver overlay2 >"$STATE/dockerd.log" 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && return; sleep 1; done
  echo "dockerd did not answer within 60 s; see $STATE/dockerd.log" >&2
  exit 1
}

ensure_local_base() {
  if docker image inspect "$LOCAL_BASE" >/dev/null 2>&1; then return; fi
  command -v debootstrap >/dev/null || run apt-get install -y -qq --no-install-recommends debootstrap
  local mirror rootfs
  mirror=$( { grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}'
              grep -hE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | awk '{print $2}'
            } | grep -m1 -E '/debian/?$' || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  rootfs="$STATE/rootfs"
  echo "making $LOCAL_BASE with debootstrap from $mirror (about 2 minutes, once)" >&2
  run rm -rf "$rootfs"
  run debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$STATE/debootstrap.log"
  run rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  # Trust what the host trusts (a proxy's CA): pip inside builds goes through it.
  run mkdir -p "$rootfs/usr/local/share/ca-certificates"
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    run cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
  fi
  run mkdir -p "$rootfs/etc/ssl/certs"
  run cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
  echo "+ tar -C $rootfs -c . | docker import -c 'CMD [\"/bin/bash\"]' - $LOCAL_BASE" >&2
  tar -C "$rootfs" -c . | docker import -c 'CMD ["/bin/bash"]' - "$LOCAL_BASE" >/dev/null
  run rm -rf "$rootfs"
}

ensure_engine
if [ -z "${BASE:-}" ]; then ensure_local_base; BASE=$LOCAL_BASE; fi
case "$VARIANT" in
  cpu) DOCKERFILE=docker/Dockerfile; TAG=${TAG:-shortlist:cpu} ;;
  cuda) DOCKERFILE=docker/Dockerfile.cuda; TAG=${TAG:-shortlist:cuda} ;;
  *) echo "usage: $0 [cpu|cuda]" >&2; exit 2 ;;
esac
run docker build --network host --build-arg "BASE=$BASE" -f "$DOCKERFILE" -t "$TAG" .
docker image inspect "$TAG" --format "built $TAG: {{.Size}} bytes" >&2
