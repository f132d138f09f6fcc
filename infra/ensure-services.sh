#!/usr/bin/env bash
# Start RabbitMQ (with the management plugin, which Flower's broker tab needs)
# and Redis when they are not already running on this machine.
set -euo pipefail

wait_port() {  # host port seconds
  for _ in $(seq 1 "$3"); do
    (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null && return 0
    sleep 1
  done
  return 1
}

if ! wait_port 127.0.0.1 5672 1; then
  if ! command -v rabbitmq-server >/dev/null; then
    echo "RabbitMQ is not running and not installed; installing it (Debian packages)" >&2
    apt-get update -qq && apt-get install -y -qq rabbitmq-server >/dev/null
  fi
  echo "starting RabbitMQ" >&2
  rabbitmq-server -detached
  wait_port 127.0.0.1 5672 90 || { echo "RabbitMQ did not start" >&2; exit 1; }
fi
if ! rabbitmq-plugins list -e -m 2>/dev/null | grep -qx rabbitmq_management; then
  rabbitmq-plugins enable rabbitmq_management >/dev/null
fi
wait_port 127.0.0.1 15672 60 || { echo "RabbitMQ management API did not start" >&2; exit 1; }

if ! wait_port 127.0.0.1 6379 1; then
  if ! command -v redis-server >/dev/null; then
    echo "Redis is not running and not installed; installing it (Debian packages)" >&2
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  fi
  echo "starting Redis" >&2
  # Jobs live in Redis: with the append-only file on they survive a Redis restart (a
  # gateway warns at start when its Redis keeps nothing).
  redis_dir="${XDG_STATE_HOME:-$HOME/.local/state}/shoal/redis"
  mkdir -p "$redis_dir"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly yes \
    --appendfsync everysec --dir "$redis_dir" --logfile "$redis_dir/redis.log"
fi
wait_port 127.0.0.1 6379 30 || { echo "Redis did not start" >&2; exit 1; }
