#!/usr/bin/env bash
# A 3-node RabbitMQ cluster on this one machine, for tests, benchmarks and fault scripts.
#
# Usage: infra/rabbitmq-cluster.sh COMMAND
#   start          start the cluster (idempotent: nodes already running are kept) and wait
#                  until all nodes run and form one cluster; a node whose VM dies while
#                  booting is launched again (twice at most: see await_node)
#   stop           stop every node and remove the cluster's folder (data, logs, cookie)
#   status         each node: running or not, its ports; the cluster's running members
#   stop-node N    stop node N (1..3) gracefully (rabbitmqctl stop); the others keep the
#                  cluster (quorum queues keep a majority with 2 of 3)
#   kill-node N    SIGKILL node N's Erlang VM (a crash, not a shutdown)
#   start-node N   start node N again and wait until it runs and has rejoined
#   env            print SHOAL_BROKER_URL and SHOAL_MANAGEMENT_URL for all nodes (`;`-separated,
#                  shoal's failover lists), for `eval "$(infra/rabbitmq-cluster.sh env)"`
#   urls           the AMQP URLs, one a line;  leader QUEUE [VHOST]: the node leading a queue
#
# Node N (1..3) is shoalN@localhost, AMQP on 127.0.0.1:$((AMQP_BASE+N)) (5681..5683),
# Erlang distribution on $((DIST_BASE+N)) (25681..25683), management API on
# 127.0.0.1:$((MGMT_BASE+N)) (15681..15683); user guest/guest (loopback only, as by
# default). Everything lives under $SHOAL_CLUSTER_DIR (default /tmp/shoal-rmq-cluster):
# nodeN/{mnesia,log,rabbitmq.conf}, the shared Erlang cookie ($DIR/.erlang.cookie, the
# nodes' and the CLI's HOME) and the enabled plugins (management). Environment overrides:
# SHOAL_CLUSTER_DIR, SHOAL_CLUSTER_AMQP_BASE (5680), SHOAL_CLUSTER_DIST_BASE (25680),
# SHOAL_CLUSTER_MGMT_BASE (15680), SHOAL_CLUSTER_NAME (shoal: nodes shoal1..3@localhost),
# SHOAL_CLUSTER_TIMEOUT_S (120, per wait). Two clusters at once need a different dir,
# name and port bases each (tests/e2e/test_broker_failover.py runs one of its own).
#
# The system RabbitMQ (rabbit@localhost on 5672/15672/25672) is never touched: the nodes
# get their own names, ports, data, config and env file (RABBITMQ_CONF_ENV_FILE, so
# /etc/rabbitmq/rabbitmq-env.conf's NODENAME does not apply); they share the machine's
# epmd (127.0.0.1:4369), as every Erlang node on a host does.
#
# Quorum queues declared on this cluster get a member on each of the 3 nodes (the default
# initial group size is the cluster size when it is 3 or less); their leader is the node
# the declaring client is connected to. `leader QUEUE` tells which node leads one now.
set -euo pipefail

DIR="${SHOAL_CLUSTER_DIR:-/tmp/shoal-rmq-cluster}"
AMQP_BASE="${SHOAL_CLUSTER_AMQP_BASE:-5680}"
DIST_BASE="${SHOAL_CLUSTER_DIST_BASE:-25680}"
MGMT_BASE="${SHOAL_CLUSTER_MGMT_BASE:-15680}"
TIMEOUT_S="${SHOAL_CLUSTER_TIMEOUT_S:-120}"
NAME="${SHOAL_CLUSTER_NAME:-shoal}"
NODES=(1 2 3)
RMQ_BIN=/usr/lib/rabbitmq/bin

node_name() { echo "$NAME$1@localhost"; }
node_dir() { echo "$DIR/node$1"; }

check_node() {
  case "${1:-}" in 1|2|3) ;; *) echo "node must be 1, 2 or 3, not '${1:-}'" >&2; exit 2 ;; esac
}

# The environment every rabbitmq-server / rabbitmqctl call of this cluster runs with.
node_env() {
  local n=$1 d
  d=$(node_dir "$n")
  echo HOME="$DIR" \
    RABBITMQ_CONF_ENV_FILE="$DIR/rabbitmq-env.conf" \
    RABBITMQ_NODENAME="$(node_name "$n")" \
    RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
    RABBITMQ_NODE_PORT="$((AMQP_BASE + n))" \
    RABBITMQ_DIST_PORT="$((DIST_BASE + n))" \
    RABBITMQ_MNESIA_BASE="$d/mnesia" \
    RABBITMQ_LOG_BASE="$d/log" \
    RABBITMQ_PID_FILE="$d/pid" \
    RABBITMQ_CONFIG_FILE="$d/rabbitmq.conf" \
    RABBITMQ_ADVANCED_CONFIG_FILE="$d/advanced.config" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$DIR/enabled_plugins" \
    ERL_EPMD_ADDRESS=127.0.0.1 \
    RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="'-kernel inet_dist_use_interface {127,0,0,1}'"
}

ctl() {  # node, rabbitmqctl arguments...
  local n=$1
  shift
  env HOME="$DIR" RABBITMQ_CONF_ENV_FILE="$DIR/rabbitmq-env.conf" ERL_EPMD_ADDRESS=127.0.0.1 \
    "$RMQ_BIN/rabbitmqctl" -n "$(node_name "$n")" "$@"
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

running() {  # node: its VM answers and its AMQP port is open
  local n=$1 pid
  [ -f "$(node_dir "$n")/pid" ] || return 1
  pid=$(cat "$(node_dir "$n")/pid" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && port_open "$((AMQP_BASE + n))"
}

prepare() {
  mkdir -p "$DIR"
  if [ ! -f "$DIR/.erlang.cookie" ]; then
    # One cookie for the three nodes and the CLI (they find it in HOME).
    head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' | tr 'a-f' 'A-F' >"$DIR/.erlang.cookie"
    chmod 400 "$DIR/.erlang.cookie"
  fi
  : >"$DIR/rabbitmq-env.conf"
  echo "[rabbitmq_management]." >"$DIR/enabled_plugins"
  for n in "${NODES[@]}"; do
    local d
    d=$(node_dir "$n")
    mkdir -p "$d/mnesia" "$d/log"
    cat >"$d/rabbitmq.conf" <<EOF
listeners.tcp.local = 127.0.0.1:$((AMQP_BASE + n))
management.tcp.ip = 127.0.0.1
management.tcp.port = $((MGMT_BASE + n))
cluster_partition_handling = pause_minority
log.file.level = info
log.console = false
EOF
  done
}

launch() {  # node: start its VM in the background (no wait)
  local n=$1 d
  d=$(node_dir "$n")
  running "$n" && return 0
  port_open "$((AMQP_BASE + n))" && {
    echo "port $((AMQP_BASE + n)) is taken by something else than node $n" >&2; exit 1; }
  # setsid: the node outlives this script and the shell that ran it.
  # In its own folder: a VM that dies writes erl_crash.dump there, not in the caller's cwd.
  # Every descriptor redirected: a caller reading this script's output (a test's
  # subprocess pipe) must not wait for the node to exit.
  rm -f "$d/pid"
  (cd "$d" && eval "exec env $(node_env "$n") ERL_CRASH_DUMP=$d/erl_crash.dump \
    setsid $RMQ_BIN/rabbitmq-server") </dev/null >"$d/log/startup.log" 2>&1 &
  # The subshell execs the server, so $! is the node for as long as its VM lives.
  echo $! >"$d/launcher.pid"
}

died_booting() {  # node: the server this script launched has exited without running
  local pid
  pid=$(cat "$(node_dir "$1")/launcher.pid" 2>/dev/null) || return 1
  [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null && ! running "$1"
}

await_node() {  # node: until it has booted; a VM that dies while booting is launched again
  local n=$1 deadline=$((SECONDS + TIMEOUT_S)) attempt=1 d
  d=$(node_dir "$n")
  until running "$n" && ctl "$n" -q await_startup --timeout 5 >/dev/null 2>&1; do
    if died_booting "$n" && [ "$attempt" -lt 3 ]; then
      # RabbitMQ 3.10 can crash at boot ("incompatible_feature_flags ... badmap") when
      # it syncs feature flags with a peer that is itself still booting, as all three do
      # after `start` on stopped nodes; the peers are further along the second time.
      mv "$d/log/startup.log" "$d/log/startup.failed-$attempt.log"
      echo "node $n's VM died while booting (see $d/log/startup.failed-$attempt.log);" \
        "launching it again" >&2
      attempt=$((attempt + 1))
      launch "$n"
    elif [ "$SECONDS" -ge "$deadline" ] || died_booting "$n"; then
      echo "node $n did not start within ${TIMEOUT_S}s; see $d/log" >&2
      tail -n 20 "$d/log/startup.log" >&2 || true
      exit 1
    fi
    sleep 0.5
  done
}

members() {  # node: the running members it sees, one a line
  ctl "$1" -q cluster_status --formatter json 2>/dev/null |
    python3 -c 'import json,sys; print("\n".join(json.load(sys.stdin)["running_nodes"]))'
}

join() {  # node: make it a member of node 1's cluster unless it is one
  local n=$1
  if members 1 | grep -x "$(node_name "$n")" >/dev/null; then
    return 0
  fi
  local log
  log="$(node_dir "$n")/log/join.log"
  { ctl "$n" -q stop_app && ctl "$n" -q reset && ctl "$n" -q join_cluster "$(node_name 1)" &&
    ctl "$n" -q start_app; } >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
}

await_cluster() {
  local deadline=$((SECONDS + TIMEOUT_S)) want
  want=$(for n in "${NODES[@]}"; do node_name "$n"; done | sort)
  until [ "$(members 1 | sort)" = "$want" ]; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "the cluster did not form within ${TIMEOUT_S}s: $(members 1 | tr '\n' ' ')" >&2
      exit 1
    fi
    sleep 0.5
  done
  for n in "${NODES[@]}"; do
    until port_open "$((MGMT_BASE + n))"; do
      [ "$SECONDS" -ge "$deadline" ] && { echo "node $n's management API is not up" >&2; exit 1; }
      sleep 0.5
    done
  done
}

start() {
  prepare
  # All at once: a node that was not the last to stop waits for its peers at boot.
  for n in "${NODES[@]}"; do launch "$n"; done
  for n in "${NODES[@]}"; do await_node "$n"; done
  for n in 2 3; do join "$n"; done
  await_cluster
  echo "cluster up: $(members 1 | tr '\n' ' ')"
}

stop_node() {
  local n=$1 pid
  check_node "$n"
  [ -f "$(node_dir "$n")/pid" ] || return 0
  pid=$(cat "$(node_dir "$n")/pid" 2>/dev/null || true)
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    ctl "$n" -q stop "$(node_dir "$n")/pid" >/dev/null 2>&1 || kill -KILL "$pid" 2>/dev/null || true
  fi
}

kill_node() {
  local n=$1 pid
  check_node "$n"
  pid=$(cat "$(node_dir "$n")/pid" 2>/dev/null || true)
  [ -n "$pid" ] && kill -KILL "$pid" 2>/dev/null || true
  # The VM's helpers (erl_child_setup, inet_gethost) end with it.
}

start_node() {
  local n=$1
  check_node "$n"
  [ -f "$DIR/.erlang.cookie" ] || { echo "no cluster in $DIR: run start first" >&2; exit 1; }
  launch "$n"
  await_node "$n"
  await_cluster
}

stop_all() {
  for n in "${NODES[@]}"; do stop_node "$n" & done
  wait
  for n in "${NODES[@]}"; do kill_node "$n"; done
  rm -rf "$DIR"
}

status() {
  for n in "${NODES[@]}"; do
    local state=stopped
    running "$n" && state=running
    printf 'node %s %s %s amqp=%s dist=%s management=%s\n' "$n" "$(node_name "$n")" "$state" \
      "$((AMQP_BASE + n))" "$((DIST_BASE + n))" "$((MGMT_BASE + n))"
  done
  for n in "${NODES[@]}"; do
    if running "$n"; then
      echo "cluster (seen by node $n): $(members "$n" | tr '\n' ' ')"
      return 0
    fi
  done
  echo "cluster: no node running"
}

urls() { for n in "${NODES[@]}"; do echo "amqp://guest:guest@127.0.0.1:$((AMQP_BASE + n))//"; done; }

env_lines() {
  local mgmt
  mgmt=$(for n in "${NODES[@]}"; do echo "http://guest:guest@127.0.0.1:$((MGMT_BASE + n))/api/"; done)
  echo "export SHOAL_BROKER_URL='$(urls | paste -sd';')'"
  echo "export SHOAL_MANAGEMENT_URL='$(echo "$mgmt" | paste -sd';')'"
}

leader() {  # queue [vhost]: the node leading it, asked of the first running node
  local queue=$1 vhost=${2:-/} n
  for n in "${NODES[@]}"; do
    running "$n" || continue
    python3 - "$((MGMT_BASE + n))" "$queue" "$vhost" <<'EOF'
import base64, json, sys, urllib.parse, urllib.request
port, queue, vhost = sys.argv[1:]
url = f"http://127.0.0.1:{port}/api/queues/{urllib.parse.quote(vhost, safe='')}/{urllib.parse.quote(queue, safe='')}"
request = urllib.request.Request(url, headers={"Authorization": "Basic " + base64.b64encode(b"guest:guest").decode()})
info = json.load(urllib.request.urlopen(request, timeout=5))
print(info.get("leader") or info.get("node"))
EOF
    return 0
  done
  echo "no node running" >&2
  exit 1
}

case "${1:-}" in
  start) start ;;
  stop) stop_all ;;
  status) status ;;
  stop-node) stop_node "${2:-}" ;;
  kill-node) kill_node "${2:-}" ;;
  start-node) start_node "${2:-}" ;;
  env) env_lines ;;
  urls) urls ;;
  leader) leader "${2:?queue name}" "${3:-/}" ;;
  *) sed -n '2,16p' "$0" >&2; exit 2 ;;
esac
