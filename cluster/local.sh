#!/usr/bin/env bash
# A local Ray cluster on 127.0.0.1: one head plus N worker nodes (separate raylets on this machine).
#
#   cluster/local.sh start [--workers N] [--num-cpus C] [--port P] [--dashboard-port D] [--auth]
#                          [--state-dir DIR] [--fake-autoscaling CONFIG]
#   cluster/local.sh stop   [--port P | --state-dir DIR]
#   cluster/local.sh status [--port P | --state-dir DIR]
#   cluster/local.sh add-node  [--port P | --state-dir DIR]      (one more worker node joins)
#   cluster/local.sh kill-node I [--port P | --state-dir DIR]    (SIGKILL all of node I: a lost VM)
#
# Every node runs `ray start --block` in its own process group, recorded in DIR/pids; `stop` ends
# exactly those groups (never `ray stop`, which would kill every Ray on the machine).
# Nodes share no directory, as on a real cluster: node i (0 = head) has DIR/node-i/ray (Ray's
# --temp-dir: sessions, logs, object spilling, Train's local staging), DIR/node-i/work (the cwd of
# its raylet, hence of its workers and, on the head, of job drivers without a working_dir) and
# DIR/node-i/tmp (TMPDIR). Everything else (AWS_ENDPOINT_URL, VITP_STORE, MLFLOW_TRACKING_URI, ...)
# is inherited from the environment `start` runs in, by every node, worker and job driver.
# --auth turns on token authentication (RAY_AUTH_MODE=token) with a fresh token in DIR/auth_token;
# clients then need RAY_AUTH_TOKEN_PATH=DIR/auth_token (printed on start). Without --auth the
# cluster runs with RAY_AUTH_MODE=disabled explicitly, so a stray ~/.ray/auth_token does not
# switch it on half-way. The dashboard and Jobs API listen on 127.0.0.1 only; GCS, raylets, agents,
# metrics, the client server and workers listen on all interfaces or this machine's address: Ray
# 2.60 takes the machine's address for a node given 127.0.0.1, and for a client's 127.0.0.1:PORT,
# unless its multi-node support is off (which refuses worker nodes). Use --auth beyond a laptop.
# --fake-autoscaling CONFIG runs Ray's autoscaler on the head with CONFIG, a launcher config whose
# provider is Ray's fake multi-node one (`type: fake_multinode`): the worker nodes it launches are
# raylets on this machine, in the head's process group (so `stop` ends them too).
# Nothing leaves the machine: Ray's usage stats and MLflow's telemetry are off on every node unless
# you export RAY_USAGE_STATS_ENABLED=1 or MLFLOW_DISABLE_TELEMETRY=false before `start`.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
# The venv's Python (same interpreter for nodes and jobs, so `vitp` resolves inside jobs).
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3)"
BIN="$(dirname "$PYTHON")"

cmd="${1:-}"; shift || true
case "$cmd" in -h|--help) sed -n '2,29p' "$0"; exit 0 ;; esac
node_index=""
if [ "$cmd" = kill-node ]; then node_index="${1:-}"; shift || true; fi
workers=1; num_cpus=2; port=6390; dash_port=8275; auth=0; state_dir=""; timeout=90; autoscaling=""
while [ $# -gt 0 ]; do
  case "$1" in
    --workers) workers="$2"; shift 2 ;;
    --num-cpus) num_cpus="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --dashboard-port) dash_port="$2"; shift 2 ;;
    --auth) auth=1; shift ;;
    --state-dir) state_dir="$2"; shift 2 ;;
    --timeout) timeout="$2"; shift 2 ;;
    --fake-autoscaling) autoscaling="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"; shift 2 ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "cluster/local.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
# Short default path: Ray puts Unix sockets under the temp dir and those are limited to 107 bytes.
state_dir="${state_dir:-/tmp/vitp-ray-$port}"

# The state dir holds the auth token, the pids `stop` signals and every node's files, so it must be
# this user's only. The default is a fixed name in the shared /tmp that another user could make
# first (a link to a directory of theirs, or one holding pids of their choosing): refused, never
# followed. One of ours that others could write to is made 700.
if [ "$cmd" = start ] && [ ! -e "$state_dir" ] && [ ! -L "$state_dir" ]; then
  mkdir -p -m 700 "$state_dir"
fi
if [ -L "$state_dir" ] || { [ -e "$state_dir" ] && [ ! -d "$state_dir" ]; }; then
  echo "cluster/local.sh: $state_dir is a link or not a directory: remove it (another user may have made it) or pass --state-dir DIR" >&2
  exit 2
fi
if [ -e "$state_dir" ]; then
  if [ ! -O "$state_dir" ]; then
    echo "cluster/local.sh: $state_dir belongs to another user: have it removed or pass --state-dir DIR (a directory of yours)" >&2
    exit 2
  fi
  chmod 700 "$state_dir"
fi

free_port() {
  # A free port on 127.0.0.1 that is none of the ports given (a port --port/--dashboard-port names is
  # free until its component binds it, and `ray start` refuses two components on one port), chosen
  # below the ephemeral range so no outgoing connection takes it before its server binds it.
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m vitp.net "$@"
}

port_in_use() {
  "$PYTHON" - "$1" <<'EOF'
import socket, sys
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(0)
sys.exit(1)
EOF
}

stop_cluster() {
  local pidfile="$state_dir/pids"
  if [ ! -f "$pidfile" ]; then
    echo "cluster/local.sh: no cluster recorded in $state_dir (nothing to stop)"; return 0
  fi
  # Workers first, then the head. Only each node's `ray start --block` leader gets SIGTERM: it
  # shuts its own daemons down in order (signalling the whole group at once leaves the raylet
  # and GCS hanging); whatever is left of the group after 20 s gets SIGKILL.
  local pids; pids="$(tac "$pidfile")"
  for pid in $pids; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 40); do
    local alive=0
    for pid in $pids; do
      if [ -n "$(ps -o pid= -g "$pid" 2>/dev/null)" ]; then alive=1; fi
    done
    [ "$alive" = 0 ] && break
    sleep 0.5
  done
  local stuck=() left=""
  for pid in $pids; do
    if [ -n "$(ps -o pid= -g "$pid" 2>/dev/null)" ]; then
      stuck+=("$pid")
      # what was left, by program name (e.g. raylet, gcs_server, ray::IDLE), for the message
      left="$left; $pid: $(ps -o comm= -g "$pid" 2>/dev/null | sort | uniq -c | awk '{printf "%s%s", sep, $2 " x" $1; sep=", "}')"
    fi
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
  if [ ${#stuck[@]} -gt 0 ]; then
    echo "cluster/local.sh: node process group(s) ${stuck[*]} still ran 20 s after SIGTERM (${left#; }): killed" >&2
  fi
  rm -f "$pidfile"
  echo "stopped local Ray cluster ($state_dir)"
}

wait_nodes() {
  # wait_nodes WANT PREFIX [PID...]: ready = the GCS reports WANT nodes alive, counting only those
  # whose raylet socket lies under PREFIX when it is not empty (a node's own temp dir: counting all
  # would not do after a kill-node, since a killed node counts as alive until the GCS misses its
  # heartbeats). (The head's job agent can come up a few seconds later; `vitp submit` retries
  # while the cluster answers "No available agent".) Gives up at once when one of the PIDs
  # (nodes' `ray start` leaders) has exited.
  local want="$1" prefix="$2" deadline=$((SECONDS + timeout)) pid
  shift 2
  while [ $SECONDS -lt $deadline ]; do
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null || return 1; done
    if "$PYTHON" - "$port" "$want" "$prefix" <<'EOF' 2>/dev/null
import sys
from ray._private.state import GlobalState
from ray._raylet import GcsClientOptions
gs = GlobalState()
gs._initialize_global_state(GcsClientOptions.create(f"127.0.0.1:{sys.argv[1]}", None, allow_cluster_id_nil=True, fetch_cluster_id_if_nil=False))
alive = [n for n in gs.node_table() if n["Alive"] and n["RayletSocketName"].startswith(sys.argv[3])]
sys.exit(0 if len(alive) >= int(sys.argv[2]) else 1)
EOF
    then
      return 0
    fi
    sleep 1
  done
  return 1
}

start_worker() {
  # Worker node $1 joins the head; its `ray start` leader pid goes to worker_pids[$1 - 1]
  # (start_cluster's array; the same port settings as the head's, see there).
  local i="$1"
  local args=(--node-ip-address 127.0.0.1 --num-cpus "$num_cpus"
              --dashboard-agent-listen-port "$(free_port "$port" "$dash_port" "$agent_port" "$client_port")"
              --min-worker-port 0 --max-worker-port 0 --block)
  node_dirs "$i"
  # --temp-dir on a worker node: its own sessions/sockets/spill dir (without it a joining node
  # uses the head's temp dir, which only works where they share a disk).
  (cd "$state_dir/node-$i/work" && TMPDIR="$state_dir/node-$i/tmp" exec setsid "$BIN/ray" start \
    --address "127.0.0.1:$port" --temp-dir "$state_dir/node-$i/ray" "${args[@]}" \
    > "$state_dir/logs/worker-$i.log" 2>&1 < /dev/null) 9>&- &  # (fd 9: add-node's lock, not the node's)
  worker_pids[$((i - 1))]=$!
}

write_pids() {
  # head first, then the workers: `stop` ends them in reverse order
  printf '%s\n' "$head_pid" ${worker_pids[@]+"${worker_pids[@]}"} > "$state_dir/pids"
}

node_dirs() {
  # Node $1's private directories (see the header); 700, like the state dir.
  mkdir -p "$state_dir/node-$1/ray" "$state_dir/node-$1/work" "$state_dir/node-$1/tmp"
  chmod 700 "$state_dir/node-$1"
}

node_env() {
  # The environment every node of this cluster starts in (start, add-node).
  export PATH="$BIN:$PATH"
  # Nothing leaves the machine unless the caller opts in (exports 1 / false): Ray's usage stats,
  # which the head would send to usage-stats.ray.io (`ray start` reads this instead of
  # --disable-usage-stats), and MLflow's telemetry in every driver, worker and trial (they import
  # MLflow, which would post usage events to its telemetry service).
  export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"
  export MLFLOW_DISABLE_TELEMETRY="${MLFLOW_DISABLE_TELEMETRY:-true}"
  # `stop` SIGTERMs each node's `ray start`, which first drains its node until it is idle, for up to
  # RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S (Ray's default: 30 s). Ray Data's detached actors never
  # leave, so after any job that read data every stop sat out its 20 s and ended in SIGKILL. No
  # node here serves traffic a drain would protect: off unless the caller exports a value.
  export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}"
  if [ "$auth" = 1 ]; then
    export RAY_AUTH_MODE=token
    export RAY_AUTH_TOKEN_PATH="$state_dir/auth_token"
    unset RAY_AUTH_TOKEN
  else
    export RAY_AUTH_MODE=disabled
  fi
  # Every process of every node finds this cluster by RAY_ADDRESS, as KubeRay sets it in each Ray
  # container: Ray's state API, which Train's placement-group cleaner asks every second, otherwise
  # scans the machine and fails with a traceback when another Ray runs beside this one.
  export RAY_ADDRESS="127.0.0.1:$port"
}

start_cluster() {
  if [ -f "$state_dir/pids" ]; then
    echo "cluster/local.sh: a cluster is already recorded in $state_dir: run 'cluster/local.sh stop --state-dir $state_dir' first" >&2
    exit 1
  fi
  for p in "$port" "$dash_port"; do
    if port_in_use "$p"; then
      echo "cluster/local.sh: port $p on 127.0.0.1 is in use (another Ray?): pick --port/--dashboard-port" >&2
      exit 1
    fi
  done
  mkdir -p "$state_dir/logs"
  chmod 700 "$state_dir"
  if [ "$auth" = 1 ]; then
    # A fresh random token per cluster, readable only by this user.
    (umask 077; "$PYTHON" -c 'import secrets; print(secrets.token_hex(32), end="")' > "$state_dir/auth_token")
  else
    echo "cluster/local.sh: token authentication is off (pass --auth to turn it on)" >&2
  fi
  # what add-node needs to know of this cluster
  printf 'port=%s\ndash_port=%s\nnum_cpus=%s\nauth=%s\n' "$port" "$dash_port" "$num_cpus" "$auth" \
    > "$state_dir/settings"
  node_env
  # Every raylet here would hand out worker ports from the same default range (10002-19999);
  # 0/0 lets the OS pick each worker's port, so nodes on one machine never collide.
  local agent_port client_port
  agent_port="$(free_port "$port" "$dash_port")"
  client_port="$(free_port "$port" "$dash_port" "$agent_port")"
  local common=(--node-ip-address 127.0.0.1 --num-cpus "$num_cpus"
                --dashboard-agent-listen-port "$agent_port" --min-worker-port 0 --max-worker-port 0 --block)
  # The head alone offers vitp_driver, which the job specs' drivers ask for (entrypoint_resources),
  # as on the cloud launchers and KubeRay: a driver never lands on a worker node that may go away.
  local head_pid worker_pids=() head_extra=()
  if [ -n "$autoscaling" ]; then
    head_extra=(--autoscaling-config "$autoscaling")
    export RAY_FAKE_CLUSTER=1 AUTOSCALER_UPDATE_INTERVAL_S=1
  fi
  node_dirs 0
  (cd "$state_dir/node-0/work" && TMPDIR="$state_dir/node-0/tmp" exec setsid "$BIN/ray" start --head \
    --port "$port" --dashboard-host 127.0.0.1 --dashboard-port "$dash_port" --include-dashboard true \
    --ray-client-server-port "$client_port" --temp-dir "$state_dir/node-0/ray" "${common[@]}" \
    --resources '{"vitp_driver": 16}' ${head_extra[@]+"${head_extra[@]}"} > "$state_dir/logs/head.log" 2>&1 < /dev/null) &
  head_pid=$!
  write_pids
  if ! wait_nodes 1 "" "$head_pid"; then
    echo "cluster/local.sh: head did not come up (it exited, or not within ${timeout}s); log $state_dir/logs/head.log:" >&2
    tail -n 30 "$state_dir/logs/head.log" >&2
    stop_cluster >&2; exit 1
  fi
  for i in $(seq 1 "$workers"); do start_worker "$i"; done
  write_pids
  if ! wait_nodes $((workers + 1)) "" ${worker_pids[@]+"${worker_pids[@]}"}; then
    # A joining `ray start` gives up when its raylet takes over 30 s to register (a limit fixed
    # in Ray), which a loaded machine can hit: start such a node once more before failing.
    local retried=0
    for i in $(seq 1 "$workers"); do
      if ! kill -0 "${worker_pids[$((i - 1))]}" 2>/dev/null; then
        echo "cluster/local.sh: worker node $i exited during start-up; starting it again" >&2
        kill -KILL -- "-${worker_pids[$((i - 1))]}" 2>/dev/null || true
        mv "$state_dir/logs/worker-$i.log" "$state_dir/logs/worker-$i.failed.log"
        start_worker "$i"; retried=1
      fi
    done
    write_pids
    if [ "$retried" = 0 ] || ! wait_nodes $((workers + 1)) "" ${worker_pids[@]+"${worker_pids[@]}"}; then
      echo "cluster/local.sh: only some of the $((workers + 1)) nodes joined within ${timeout}s; logs in $state_dir/logs" >&2
      tail -n 30 "$state_dir"/logs/worker-*.log >&2
      stop_cluster >&2; exit 1
    fi
  fi
  echo "local Ray cluster: head + $workers worker node(s), $num_cpus CPUs each, on 127.0.0.1"
  echo "  RAY_ADDRESS=127.0.0.1:$port"
  echo "  dashboard / jobs API: http://127.0.0.1:$dash_port"
  echo "  node directories (Ray temp dir, cwd, TMPDIR): $state_dir/node-{0..$workers}/{ray,work,tmp}"
  if [ "$auth" = 1 ]; then
    echo "  token auth on: export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$state_dir/auth_token"
  fi
  echo "  stop: cluster/local.sh stop --state-dir $state_dir"
}

read_settings() {
  # The settings `start` recorded for the cluster in $state_dir (known keys only).
  if [ ! -f "$state_dir/pids" ] || [ ! -f "$state_dir/settings" ]; then
    echo "cluster/local.sh: no cluster recorded in $state_dir (start one first)" >&2; exit 1
  fi
  local key value
  while IFS='=' read -r key value; do
    case "$key" in
      port) port="$value" ;; dash_port) dash_port="$value" ;;
      num_cpus) num_cpus="$value" ;; auth) auth="$value" ;;
    esac
  done < "$state_dir/settings"
}

add_node() {
  read_settings
  node_env
  # start_worker's new port avoids these (the head's agent and client ports need no avoiding now:
  # they are bound)
  local i head_pid worker_pids=() agent_port="$port" client_port="$dash_port"
  # Two add-nodes at once (replacements of two lost nodes) took the same index, so two nodes shared
  # one node's directories and one pid was lost from DIR/pids: index, start and record under a lock.
  exec 9>>"$state_dir/add-node.lock"
  flock 9
  mapfile -t worker_pids < "$state_dir/pids"
  head_pid="${worker_pids[0]}"
  worker_pids=("${worker_pids[@]:1}")
  i=$((${#worker_pids[@]} + 1))  # a new index: a killed node's directories stay as they were
  start_worker "$i"
  write_pids
  exec 9>&-
  if ! wait_nodes 1 "$state_dir/node-$i/ray/" "${worker_pids[$((i - 1))]}"; then
    echo "cluster/local.sh: node $i did not join within ${timeout}s; log $state_dir/logs/worker-$i.log:" >&2
    tail -n 30 "$state_dir/logs/worker-$i.log" >&2
    exit 1
  fi
  echo "node $i joined ($num_cpus CPUs, directories $state_dir/node-$i/{ray,work,tmp})"
}

kill_node() {
  read_settings
  local pids last
  mapfile -t pids < "$state_dir/pids"
  last=$((${#pids[@]} - 1))
  case "$node_index" in
    ''|*[!0-9]*) echo "cluster/local.sh: kill-node takes a worker node's index (1..$last; 0 is the head: use stop)" >&2; exit 2 ;;
  esac
  if [ "$node_index" -lt 1 ] || [ "$node_index" -gt "$last" ]; then
    echo "cluster/local.sh: no worker node $node_index in $state_dir (1..$last; 0 is the head: use stop)" >&2
    exit 2
  fi
  # Its session: raylet, object store, agents, and the workers (each in a process group of its own)
  pkill -KILL -s "${pids[$node_index]}" 2>/dev/null || true
  echo "node $node_index killed (session ${pids[$node_index]})"
}

case "$cmd" in
  start) start_cluster ;;
  stop) stop_cluster ;;
  add-node) add_node ;;
  kill-node) kill_node ;;
  status)
    if [ -f "$state_dir/pids" ]; then
      for pid in $(cat "$state_dir/pids"); do
        if kill -0 "$pid" 2>/dev/null; then echo "node pid $pid: running"; else echo "node pid $pid: gone"; fi
      done
    else
      echo "no cluster recorded in $state_dir"
    fi ;;
  *) echo "usage: cluster/local.sh start|stop|status|add-node|kill-node [options] (see --help)" >&2; exit 2 ;;
esac
