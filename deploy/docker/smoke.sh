#!/usr/bin/env bash
# End-to-end smoke test of the container deployment, on one machine, pulling nothing from an
# image registry:
#
#   1. a base image: GPUMESH_BASE_IMAGE if given (must already be local), else a minimal Debian
#      with Python made with debootstrap and `docker import`ed as gpumesh-base:<suite> (kept,
#      and reused by the next run);
#   2. the `sim` image from deploy/docker/Dockerfile, built offline from a wheelhouse
#      (GPUMESH_WHEELHOUSE, or one deploy/docker/wheelhouse.sh fills from this machine's pip);
#   3. the Compose mesh of deploy/compose.yaml + compose.tls.yaml: `gpumesh certs`, two router
#      replicas behind the name `router`, two simulated nodes, TLS everywhere;
#   4. every container's health probe; a streamed request through a router from the host;
#      `gpumesh status --json` from both replicas; a node drained (requests go to the other
#      node) and undrained; one router replica stopped under streamed load with no request lost;
#   5. teardown: no container, network or volume of the test is left (also on failure).
#
#   bash deploy/docker/smoke.sh        (as root, or a user of the docker group with sudo-less
#                                       debootstrap; dockerd running)
#
# Settings (environment):
#   GPUMESH_BASE_IMAGE      a local image with Python 3.11+ and its venv module to build on
#   GPUMESH_DEBIAN_MIRROR   debootstrap's mirror (default: this machine's apt mirror for the
#                           suite, else http://deb.debian.org/debian)
#   GPUMESH_DEBIAN_SUITE    default bookworm (Python 3.11)
#   GPUMESH_WHEELHOUSE      a folder of wheels for the image's Python (default: made here)
#   GPUMESH_SMOKE_CLIENT    Python with gpumesh installed that runs the host-side client
#                           (default: the checkout's .venv, else python3 if it imports gpumesh,
#                           else `image`: the built image on the host's network)
#   GPUMESH_SMOKE_PROJECT   Compose project name (default gpumesh-smoke)
#   GPUMESH_SMOKE_KEEP_IMAGE=1  keep the built image gpumesh-smoke:sim
#   COMPOSE                 the Compose command (default docker-compose, else `docker compose`)
#   DOCKER_BUILDKIT         default 0: the classic builder (Debian's docker.io has no buildx)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
SUITE=${GPUMESH_DEBIAN_SUITE:-bookworm}
PROJECT=${GPUMESH_SMOKE_PROJECT:-gpumesh-smoke}
IMAGE=gpumesh-smoke
export DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0}
if [ -z "${COMPOSE:-}" ]; then
  if command -v docker-compose >/dev/null; then COMPOSE=docker-compose; else COMPOSE="docker compose"; fi
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpumesh-smoke.XXXXXX")
T0=$SECONDS

log() { printf '[smoke %4ds] %s\n' $((SECONDS - T0)) "$*" >&2; }
fail() { log "FAIL: $*"; exit 1; }
compose() {   # the test's project; no profile (Jaeger stays out), tracing off
  env -u COMPOSE_PROFILES -u COMPOSE_FILE GPUMESH_IMAGE=$IMAGE GPUMESH_VARIANT=sim \
    GPUMESH_ROUTER_PUBLISH=127.0.0.1: GPUMESH_METRICS_PUBLISH=127.0.0.1: GPUMESH_OTLP_ENDPOINT= \
    timeout 300 $COMPOSE -p "$PROJECT" -f "$ROOT/deploy/compose.yaml" \
      -f "$ROOT/deploy/compose.tls.yaml" "$@"
}
ours() { echo "label=com.docker.compose.project=$PROJECT"; }

# --- teardown: always, and prove nothing is left ------------------------------------------
leftovers() {
  {
    docker ps -aq --filter "$(ours)" | sed 's/^/container /'
    docker network ls -q --filter "$(ours)" | sed 's/^/network /'
    docker volume ls -q --filter "$(ours)" | sed 's/^/volume /'
  } 2>/dev/null
}
teardown() {
  local rc=$?
  set +e
  if [ $rc -ne 0 ] && [ -n "$(docker ps -aq --filter "$(ours)" 2>/dev/null)" ]; then
    log "logs of the failed run:"
    compose logs --no-color --tail 40 >&2
  fi
  log "teardown: $COMPOSE down"
  compose down --volumes --remove-orphans --timeout 60 >"$WORK/down.log" 2>&1 \
    || cat "$WORK/down.log" >&2
  local left
  left=$(leftovers)
  if [ -n "$left" ]; then
    log "still there after down, removing: $(echo "$left" | tr '\n' ' ')"
    docker ps -aq --filter "$(ours)" | xargs -r docker rm -f >/dev/null
    docker network ls -q --filter "$(ours)" | xargs -r docker network rm >/dev/null
    docker volume ls -q --filter "$(ours)" | xargs -r docker volume rm >/dev/null
    rc=1
  fi
  if [ "${GPUMESH_SMOKE_KEEP_IMAGE:-0}" != 1 ]; then
    docker rmi "$IMAGE:sim" >/dev/null 2>&1
    docker image prune -f --filter label=io.gpumesh.stage=build >/dev/null 2>&1
    # the classic builder also keeps the unused variant stages: untagged images made from
    # the base during this run
    local base_id id
    base_id=$(docker image inspect -f '{{.Id}}' "${BASE:-}" 2>/dev/null)
    for id in $(docker images -aq --no-trunc --filter dangling=true 2>/dev/null); do
      grep -qx "$id" "$WORK/dangling.before" 2>/dev/null && continue
      [ -n "$base_id" ] && [ "$(docker image inspect -f '{{.Parent}}' "$id")" = "$base_id" ] \
        && docker rmi "$id" >/dev/null 2>&1
    done
  fi
  left=$(leftovers)
  [ -z "$left" ] && log "left behind: no container, network or volume of project $PROJECT" \
                 || { log "LEFT BEHIND: $left"; rc=1; }
  # an interrupted debootstrap can leave its mounts (proc, devices) in the root filesystem
  awk -v w="$WORK/" 'index($2, w) == 1 { print $2 }' /proc/mounts 2>/dev/null | sort -r \
    | xargs -r -n1 umount -l 2>/dev/null
  rm -rf --one-file-system "$WORK"
  if [ $rc -eq 0 ]; then log "PASS in $((SECONDS - T0)) s"; else log "FAILED (exit $rc)"; fi
  exit $rc
}
trap teardown EXIT
trap 'exit 130' INT TERM

# --- preflight -------------------------------------------------------------------------------
docker info >/dev/null 2>&1 || fail "no container engine answers (is dockerd running?)"
command -v python3 >/dev/null || fail "python3 is needed on the host"
$COMPOSE version >/dev/null 2>&1 || fail "no Compose ($COMPOSE)"
log "docker $(docker version --format '{{.Server.Version}}'), $($COMPOSE version --short 2>/dev/null || $COMPOSE version | head -1)"
[ -z "$(leftovers)" ] || fail "project $PROJECT already has containers/networks/volumes"
docker images -aq --no-trunc --filter dangling=true >"$WORK/dangling.before"

# --- 1. base image -------------------------------------------------------------------------
host_mirror() {   # this machine's apt mirror for $SUITE (one-line and deb822 sources)
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
    | awk -v s="$SUITE" '$1 == "deb" { for (i = 2; i < NF; i++) if ($(i+1) == s && $i ~ /^(https?|file):/) { print $i; exit } }'
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -e "$f" ] && awk -v s="$SUITE" 'BEGIN { RS = ""; FS = "\n" } {
        u = ""; ok = 0
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^URIs:/) { split($i, a, /[ \t]+/); u = a[2] }
          if ($i ~ /^Suites:/) { n = split($i, b, /[ \t]+/); for (j = 2; j <= n; j++) if (b[j] == s) ok = 1 }
        }
        if (ok && u != "") { print u; exit }
      }' "$f"
  done
}
if [ -n "${GPUMESH_BASE_IMAGE:-}" ]; then
  BASE=$GPUMESH_BASE_IMAGE
  docker image inspect "$BASE" >/dev/null 2>&1 \
    || fail "GPUMESH_BASE_IMAGE=$BASE is not a local image (this test never pulls)"
  log "base image $BASE (given)"
else
  BASE=gpumesh-base:$SUITE
  if docker image inspect "$BASE" >/dev/null 2>&1; then
    log "base image $BASE (present; docker rmi it to rebuild)"
  else
    MIRROR=${GPUMESH_DEBIAN_MIRROR:-$(host_mirror | head -1)}
    MIRROR=${MIRROR:-http://deb.debian.org/debian}
    command -v debootstrap >/dev/null || fail "debootstrap missing (apt-get install debootstrap)"
    [ "$(id -u)" = 0 ] || fail "debootstrap needs root (or give GPUMESH_BASE_IMAGE)"
    log "base image $BASE: debootstrap $SUITE from $MIRROR"
    timeout 900 debootstrap --variant=minbase --include=python3,python3-venv \
      "$SUITE" "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
      || { tail -20 "$WORK/debootstrap.log" >&2; fail "debootstrap failed"; }
    rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
    tar -C "$WORK/rootfs" -c . | docker import \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$BASE" >/dev/null
    rm -rf --one-file-system "$WORK/rootfs"
    log "base image $BASE imported ($(docker image inspect -f '{{.Size}}' "$BASE" | awk '{printf "%d MB", $1/1e6}'))"
  fi
fi
read -r PYVER ARCH GLIBC < <(docker run --rm --network none "$BASE" python3 -c \
  'import platform, sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}", platform.machine(), platform.libc_ver()[1] or "0.0")') \
  || fail "$BASE has no python3"
log "base Python $PYVER on $ARCH, glibc $GLIBC"

# --- 2. the sim image, offline ---------------------------------------------------------------
CTX=$WORK/ctx
mkdir -p "$CTX/deploy/docker/wheelhouse"
if [ -n "${GPUMESH_WHEELHOUSE:-}" ]; then
  cp "$GPUMESH_WHEELHOUSE"/*.whl "$CTX/deploy/docker/wheelhouse/" \
    || fail "no wheels in GPUMESH_WHEELHOUSE=$GPUMESH_WHEELHOUSE"
else
  "$HERE/wheelhouse.sh" --python "$PYVER" --platform "manylinux_${GLIBC/./_}_$ARCH" \
    "$CTX/deploy/docker/wheelhouse" || fail "could not fill the wheelhouse"
fi
# exactly the files deploy/docker/Dockerfile.dockerignore admits
tar -C "$ROOT" --exclude=__pycache__ --exclude='*.pyc' -cf - pyproject.toml setup.py README.md \
  gpumesh router node deploy/docker/Dockerfile | tar -C "$CTX" -xf -
log "building $IMAGE:sim (builder: $([ "$DOCKER_BUILDKIT" = 1 ] && echo BuildKit || echo classic), OFFLINE=1)"
timeout 900 docker build --force-rm -f deploy/docker/Dockerfile --build-arg BASE_IMAGE="$BASE" \
  --build-arg VARIANT=sim --build-arg OFFLINE=1 -t "$IMAGE:sim" "$CTX" >"$WORK/build.log" 2>&1 \
  || { tail -30 "$WORK/build.log" >&2; fail "image build failed"; }
log "built $IMAGE:sim ($(docker image inspect -f '{{.Size}}' "$IMAGE:sim" | awk '{printf "%d MB", $1/1e6}'))"

# --- the host-side client ----------------------------------------------------------------------
CERTS=$WORK/certs
CLIENT=${GPUMESH_SMOKE_CLIENT:-}
if [ -z "$CLIENT" ]; then
  if [ -x "$ROOT/.venv/bin/python" ] && "$ROOT/.venv/bin/python" -c 'import gpumesh' 2>/dev/null; then
    CLIENT=$ROOT/.venv/bin/python
  elif python3 -c 'import gpumesh.cli' 2>/dev/null; then
    CLIENT=python3
  else
    CLIENT=image
  fi
fi
# PY: the client's Python with gpumesh; certificates under $C, this folder under $S, the load
# client's mark file under $M
mkdir -p "$WORK/mark"
if [ "$CLIENT" = image ]; then
  C=/certs S=/smoke M=/mark
  PY=(docker run --rm --network host --user "$(id -u)" -v "$CERTS:/certs:ro" -v "$HERE:/smoke:ro"
      -v "$WORK/mark:/mark:ro" --entrypoint python "$IMAGE:sim")
  log "client: $IMAGE:sim on the host's network"
else
  C=$CERTS S=$HERE M=$WORK/mark
  PY=("$CLIENT")
  log "client: $CLIENT on the host"
fi
gm() { timeout 120 "${PY[@]}" -m gpumesh.cli "$@"; }
OPERATOR=(--tls-ca "$C/ca.pem" --tls-cert "$C/operator.pem" --tls-key "$C/operator.key")
USER_TLS=(--tls-ca "$C/ca.pem" --tls-cert "$C/client.pem" --tls-key "$C/client.key")

# --- 3. the mesh -----------------------------------------------------------------------------------
log "$COMPOSE up: certs, 2 routers, node-a, node-b (TLS; Jaeger's profile left out)"
compose up -d --no-build >"$WORK/up.log" 2>&1 || { cat "$WORK/up.log" >&2; fail "compose up"; }
names() { docker ps -a --filter "$(ours)" --filter "label=com.docker.compose.service=$1" \
            --format '{{.Names}}' | sort; }
mapfile -t ROUTERS < <(names router)
[ ${#ROUTERS[@]} = 2 ] || fail "want 2 router replicas, got ${#ROUTERS[@]}"
[ "$(docker inspect -f '{{.State.ExitCode}}' "$(names certs)")" = 0 ] \
  || fail "the certs service failed"

# --- 4a. health probes ----------------------------------------------------------------------------
SERVING=("${ROUTERS[@]}" "$(names node-a)" "$(names node-b)")
for _ in $(seq 1 60); do
  states=$(for c in "${SERVING[@]}"; do docker inspect -f '{{.State.Health.Status}}' "$c"; done)
  echo "$states" | grep -q unhealthy && break
  [ "$(echo "$states" | grep -c '^healthy$')" = ${#SERVING[@]} ] && break
  sleep 2
done
for c in "${SERVING[@]}"; do
  st=$(docker inspect -f '{{.State.Health.Status}}' "$c")
  probe=$(docker inspect -f '{{join .Config.Healthcheck.Test " "}}' "$c")
  log "  $c: $st  ($probe)"
  [ "$st" = healthy ] || fail "$c is $st"
done
docker cp "${ROUTERS[0]}:/certs" "$CERTS"
chmod -R a+rX "$CERTS"
R1=$(docker port "${ROUTERS[0]}" 50050 | head -1)
R2=$(docker port "${ROUTERS[1]}" 50050 | head -1)
log "routers published on $R1 and $R2"

# --- 4b. a streamed request from the host ------------------------------------------------------
gm generate --target "$R1" --stream --max-tokens 24 "${USER_TLS[@]}" "hello mesh" \
  >"$WORK/gen.out" 2>"$WORK/gen.err" || { cat "$WORK/gen.err" >&2; fail "streamed request"; }
log "streamed through ${ROUTERS[0]}: $(tr -d '\n' <"$WORK/gen.out" | cut -c1-60)... | $(tail -1 "$WORK/gen.err")"
grep -q "completion_tokens=24" "$WORK/gen.err" || fail "the stream did not deliver 24 tokens"

# --- 4c. gpumesh status --json from both replicas ----------------------------------------------
# fleet R WANT ROUTERS: router R's `status --json` shows exactly the nodes and states of WANT
# (node=state,...), each node heartbeating to ROUTERS router replicas
fleet() {
  gm status --router "$1" --json "${OPERATOR[@]}" | python3 -c '
import json, sys
d = json.load(sys.stdin)
want = dict(kv.split("=") for kv in sys.argv[1].split(","))
nodes = {n["node_id"]: n for n in d["nodes"]}
print(d["schema"], d["router"]["id"], " ".join(
    f"{k}={n['"'state'"']}/{len(n['"'routers'"'])} routers" for k, n in sorted(nodes.items())))
ok = (d["schema"] == "gpumesh.status.v1"
      and {k: n["state"] for k, n in nodes.items()} == want
      and all(len(n["routers"]) == int(sys.argv[2]) for n in nodes.values()))
sys.exit(0 if ok else 1)' "$2" "$3"
}
wait_fleet() {   # wait_fleet WANT: both replicas show WANT (within 20 s)
  local r out
  for r in "$R1" "$R2"; do
    for _ in $(seq 1 20); do out=$(fleet "$r" "$1" 2) && break; sleep 1; done
    log "  status --json $r: $out"
    fleet "$r" "$1" 2 >/dev/null || fail "router at $r does not show $1"
  done
}
wait_fleet node-a=healthy,node-b=healthy

# --- 4d. drain and undrain node-a ---------------------------------------------------------------
gm drain node-a --router "$R1" --reason smoke --wait 60 "${OPERATOR[@]}" >&2 \
  || fail "drain node-a"
wait_fleet node-a=draining,node-b=healthy
for i in 1 2 3 4; do
  gm generate --target "$([ $((i % 2)) = 1 ] && echo "$R1" || echo "$R2")" --stream --max-tokens 8 \
    "${USER_TLS[@]}" "while node-a drains $i" >/dev/null 2>"$WORK/gen.err" || fail "request $i"
  grep -q "node=node-b" "$WORK/gen.err" || fail "request $i not served by node-b: $(tail -1 "$WORK/gen.err")"
done
log "  4 requests while node-a drained: all served by node-b"
gm undrain node-a --router "$R1" "${OPERATOR[@]}" >&2 || fail "undrain node-a"
wait_fleet node-a=healthy,node-b=healthy

# --- 4e. stop one router replica under load ----------------------------------------------------
log "streamed load on both replicas (8 streams at a time, 200 tokens each, 24 s)"
"${PY[@]}" "$S/smoke_load.py" --targets "$R1,$R2" --tls-dir "$C" --concurrency 8 --duration 24 \
  --max-tokens 200 --mark "$M/stopped" >"$WORK/load.json" 2>"$WORK/load.err" &
LOAD=$!
sleep 8
inflight=$(gm status --router "$R1" --json "${OPERATOR[@]}" \
  | python3 -c 'import json, sys; print(sum(n["router_in_flight"] for n in json.load(sys.stdin)["nodes"]))')
log "stopping ${ROUTERS[0]} with $inflight requests in flight through it"
t=$SECONDS
timeout 700 docker stop -t 660 "${ROUTERS[0]}" >/dev/null
touch "$WORK/mark/stopped"   # the load client counts the requests it starts from here on
code=$(docker inspect -f '{{.State.ExitCode}}' "${ROUTERS[0]}")
log "  ${ROUTERS[0]} stopped in $((SECONDS - t)) s, exit code $code"
[ "$code" = 0 ] || fail "the stopped router exited with $code"
wait $LOAD || { cat "$WORK/load.err" "$WORK/load.json" >&2; fail "requests lost: $(cat "$WORK/load.json")"; }
log "  load: $(cat "$WORK/load.json")"
[ "$inflight" -gt 0 ] || fail "no request was in flight through the stopped replica"
for _ in $(seq 1 20); do out=$(fleet "$R2" node-a=healthy,node-b=healthy 1) && break; sleep 1; done
fleet "$R2" node-a=healthy,node-b=healthy 1 >/dev/null || fail "the remaining router: $out"
log "  status --json $R2: $out"
log "all checks passed; tearing down"
