#!/usr/bin/env bash
# A shoal fleet's test hosts on one machine: network namespaces joined by a bridge.
#
# Usage: infra/netns-fleet.sh up | down | status
#        infra/netns-fleet.sh cut HOST | heal HOST
#        infra/netns-fleet.sh exec HOST CMD...
#        infra/netns-fleet.sh broker-start | broker-stop
#
#   up            bridge shoal-br0 (10.77.0.1/24, the root namespace: the broker's host),
#                 namespaces shoal-gw (10.77.0.10), shoal-w1 (.11), shoal-w2 (.12), each
#                 with a veth pair into the bridge; a private RabbitMQ node on
#                 10.77.0.1:5690 and a private Redis on 10.77.0.1:6390 (the system ones
#                 listen on 127.0.0.1 only and are left alone). Idempotent.
#   down          stops the private broker and Redis, removes namespaces, veths, bridge
#                 and the state folder (the broker's data).
#   cut HOST      takes HOST's link down (the bridge's end of its veth): packets vanish,
#                 as with a pulled cable; neither side's sockets see an error.
#   heal HOST     brings it back.
#   exec HOST CMD runs CMD inside HOST's namespace (HOST: gw, w1, w2).
#   broker-stop / broker-start   stop or start the private RabbitMQ node (its data kept).
#
# Hosts: SHOAL_FLEET_HOSTS (default "gw w1 w2"; gw is .10, wN is .10+N).
# Addresses for processes: broker amqp://shoal:shoal@10.77.0.1:5690//, Redis
# redis://10.77.0.1:6390/0 (printed by `status`). Runs as root (ip netns needs it).
set -euo pipefail

BRIDGE=shoal-br0
NET=10.77.0
BROKER_IP=$NET.1
BROKER_PORT=${SHOAL_FLEET_BROKER_PORT:-5690}
BROKER_DIST_PORT=${SHOAL_FLEET_BROKER_DIST_PORT:-25690}
REDIS_PORT=${SHOAL_FLEET_REDIS_PORT:-6390}
HOSTS=${SHOAL_FLEET_HOSTS:-"gw w1 w2"}
STATE=${SHOAL_FLEET_STATE:-/tmp/shoal-netns-fleet}
NODE=shoal-fleet@localhost
RABBIT_BIN=/usr/lib/rabbitmq/bin

die() { echo "netns-fleet: $*" >&2; exit 1; }

host_ip() {  # gw -> 10.77.0.10, wN -> 10.77.0.(10+N)
  case "$1" in
    gw) echo "$NET.10" ;;
    w[1-9]) echo "$NET.$((10 + ${1#w}))" ;;
    *) die "unknown host '$1' (gw, w1..w9)" ;;
  esac
}
ns() { echo "shoal-$1"; }
veth() { echo "shl-$1"; }  # the bridge's end; the namespace's end is eth0

wait_port() {  # ip port seconds
  for _ in $(seq 1 "$3"); do
    (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null && return 0
    sleep 1
  done
  return 1
}

# The private RabbitMQ node runs as root with its own HOME (so its own Erlang cookie),
# config and env file: the system node's /etc/rabbitmq files bind 127.0.0.1:5672.
rabbit_env() {
  export HOME=$STATE/rabbit
  export RABBITMQ_NODENAME=$NODE
  export RABBITMQ_NODE_IP_ADDRESS=$BROKER_IP
  export RABBITMQ_NODE_PORT=$BROKER_PORT
  export RABBITMQ_DIST_PORT=$BROKER_DIST_PORT
  export RABBITMQ_MNESIA_BASE=$STATE/rabbit/mnesia
  export RABBITMQ_LOG_BASE=$STATE/rabbit/log
  export RABBITMQ_CONFIG_FILE=$STATE/rabbit/rabbitmq.conf
  export RABBITMQ_CONF_ENV_FILE=$STATE/rabbit/rabbitmq-env.conf
  export RABBITMQ_ENABLED_PLUGINS_FILE=$STATE/rabbit/enabled_plugins
  export RABBITMQ_PID_FILE=$STATE/rabbit/rabbit.pid
  # Erlang distribution (rabbitmqctl) on loopback only, as the system node has it.
  export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
}

broker_running() {
  (rabbit_env; "$RABBIT_BIN/rabbitmqctl" -q -n "$NODE" status >/dev/null 2>&1)
}

broker_start() {
  if broker_running; then return 0; fi
  mkdir -p "$STATE/rabbit/mnesia" "$STATE/rabbit/log"
  # The processes connect from other hosts: guest/guest works only over loopback, so a
  # user of its own (made below) and loopback_users = none for the benchmarks' clients.
  cat >"$STATE/rabbit/rabbitmq.conf" <<EOF
listeners.tcp.default = $BROKER_IP:$BROKER_PORT
loopback_users = none
EOF
  : >"$STATE/rabbit/rabbitmq-env.conf"
  echo "[]." >"$STATE/rabbit/enabled_plugins"
  (rabbit_env; "$RABBIT_BIN/rabbitmq-server" -detached >/dev/null 2>&1) \
    || die "the private RabbitMQ node did not start (logs in $STATE/rabbit/log)"
  # `wait` follows the pid file until the node has booted (await_startup would give up
  # at once on a node that has not registered with epmd yet).
  (rabbit_env; "$RABBIT_BIN/rabbitmqctl" -q -n "$NODE" wait --timeout 120 "$RABBITMQ_PID_FILE" \
     >/dev/null) \
    || die "the private RabbitMQ node did not come up (logs in $STATE/rabbit/log)"
  (
    rabbit_env
    if ! "$RABBIT_BIN/rabbitmqctl" -q -n "$NODE" list_users | grep -q '^shoal'; then
      "$RABBIT_BIN/rabbitmqctl" -q -n "$NODE" add_user shoal shoal >/dev/null
      "$RABBIT_BIN/rabbitmqctl" -q -n "$NODE" set_permissions -p / shoal '.*' '.*' '.*' >/dev/null
    fi
  )
  wait_port "$BROKER_IP" "$BROKER_PORT" 60 || die "RabbitMQ is not listening on $BROKER_IP:$BROKER_PORT"
}

broker_stop() {
  if broker_running; then
    (rabbit_env; "$RABBIT_BIN/rabbitmqctl" -q -n "$NODE" stop >/dev/null 2>&1) || true
  fi
}

redis_start() {
  if wait_port "$BROKER_IP" "$REDIS_PORT" 1; then return 0; fi
  mkdir -p "$STATE/redis"
  # Not protected mode: the gateway connects from its own namespace, over the bridge.
  redis-server --daemonize yes --bind "$BROKER_IP" --port "$REDIS_PORT" --save "" \
    --protected-mode no \
    --appendonly no --dir "$STATE/redis" --logfile "$STATE/redis/redis.log" \
    --pidfile "$STATE/redis/redis.pid" >/dev/null
  wait_port "$BROKER_IP" "$REDIS_PORT" 30 || die "Redis is not listening on $BROKER_IP:$REDIS_PORT"
}

redis_stop() {
  local pidfile=$STATE/redis/redis.pid pid
  [[ -f $pidfile ]] || return 0
  pid=$(cat "$pidfile")  # Redis removes its pid file as it exits
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  rm -f "$pidfile"
}

network_up() {
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge
  fi
  ip addr replace "$BROKER_IP/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for host in $HOSTS; do
    local name; name=$(ns "$host")
    local ip; ip=$(host_ip "$host")
    local end; end=$(veth "$host")
    ip netns list | grep -qw "^$name" || ip netns add "$name"
    if ! ip link show "$end" >/dev/null 2>&1; then
      ip link add "$end" type veth peer name eth0 netns "$name"
    fi
    ip link set "$end" master "$BRIDGE"
    ip link set "$end" up
    ip -n "$name" link set lo up
    ip -n "$name" addr replace "$ip/24" dev eth0
    ip -n "$name" link set eth0 up
    ip -n "$name" route replace default via "$BROKER_IP"
  done
}

network_down() {
  for name in $(ip netns list | awk '/^shoal-/ {print $1}'); do
    # Whatever still runs in there is ours (started with `exec`): end it first.
    for pid in $(ip netns pids "$name" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$name"
  done
  for end in $(ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | grep '^shl-' || true); do
    ip link del "$end" 2>/dev/null || true
  done
  if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE"; fi
}

status() {
  echo "bridge:    $(ip -br addr show "$BRIDGE" 2>/dev/null || echo absent)"
  for host in $HOSTS; do
    local end; end=$(veth "$host")
    printf '%-10s %s  link %s\n' "$host:" "$(host_ip "$host")" \
      "$(ip -br link show "$end" 2>/dev/null | awk '{print $2}' || echo absent)"
  done
  if broker_running; then echo "broker:    amqp://shoal:shoal@$BROKER_IP:$BROKER_PORT// (up)"
  else echo "broker:    down"; fi
  if wait_port "$BROKER_IP" "$REDIS_PORT" 1; then echo "redis:     redis://$BROKER_IP:$REDIS_PORT/0 (up)"
  else echo "redis:     down"; fi
}

[[ $(id -u) == 0 ]] || die "must run as root (ip netns)"
cmd=${1:-}
shift || true
case "$cmd" in
  up) network_up; redis_start; broker_start; status ;;
  down) broker_stop; redis_stop; network_down; rm -rf "$STATE" ;;
  status) status ;;
  cut) [[ $# == 1 ]] || die "usage: cut HOST"; host_ip "$1" >/dev/null
       ip link set "$(veth "$1")" down ;;
  heal) [[ $# == 1 ]] || die "usage: heal HOST"; host_ip "$1" >/dev/null
        ip link set "$(veth "$1")" up ;;
  exec) [[ $# -ge 2 ]] || die "usage: exec HOST CMD..."; host=$1; shift
        host_ip "$host" >/dev/null; exec ip netns exec "$(ns "$host")" "$@" ;;
  broker-start) broker_start ;;
  broker-stop) broker_stop ;;
  *) awk 'NR > 1 && /^#/ {print; next} NR > 1 {exit}' "$0" >&2; exit 2 ;;
esac
