#!/usr/bin/env bash
# Make sure PostgreSQL and Redis answer on the configured URLs; start the local ones if they are
# installed but stopped; otherwise say exactly what is missing and exit non-zero.
set -euo pipefail

DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/streamserve}"
REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379/0}"

pg_host=$(python3 -c "from urllib.parse import urlparse as u; p=u('$DATABASE_URL'); print(p.hostname or '127.0.0.1')")
pg_port=$(python3 -c "from urllib.parse import urlparse as u; p=u('$DATABASE_URL'); print(p.port or 5432)")
pg_user=$(python3 -c "from urllib.parse import urlparse as u; p=u('$DATABASE_URL'); print(p.username or 'postgres')")
pg_db=$(python3 -c "from urllib.parse import urlparse as u; p=u('$DATABASE_URL'); print((p.path or '/streamserve').lstrip('/'))")
redis_host=$(python3 -c "from urllib.parse import urlparse as u; p=u('$REDIS_URL'); print(p.hostname or '127.0.0.1')")
redis_port=$(python3 -c "from urllib.parse import urlparse as u; p=u('$REDIS_URL'); print(p.port or 6379)")

is_local() { [[ "$1" == "127.0.0.1" || "$1" == "localhost" || "$1" == "::1" ]]; }

pg_up() { pg_isready -q -h "$pg_host" -p "$pg_port" 2>/dev/null; }
redis_up() { python3 - "$redis_host" "$redis_port" <<'PY' 2>/dev/null
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1)
s.sendall(b"PING\r\n"); sys.exit(0 if s.recv(16).startswith(b"+PONG") else 1)
PY
}

if ! pg_up; then
  if is_local "$pg_host" && command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ]; then
    echo "PostgreSQL is not answering on $pg_host:$pg_port; starting the local cluster…"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
    for _ in $(seq 1 30); do pg_up && break; sleep 0.5; done
  fi
  pg_up || { echo "ERROR: PostgreSQL is not reachable at $pg_host:$pg_port (DATABASE_URL). Install/start it, or point DATABASE_URL at a running server." >&2; exit 1; }
fi

if ! redis_up; then
  if is_local "$redis_host" && command -v redis-server >/dev/null; then
    echo "Redis is not answering on $redis_host:$redis_port; starting a local one…"
    redis-server --daemonize yes --bind 127.0.0.1 --port "$redis_port" --save "" --appendonly no >/dev/null
    for _ in $(seq 1 30); do redis_up && break; sleep 0.2; done
  fi
  redis_up || { echo "ERROR: Redis is not reachable at $redis_host:$redis_port (REDIS_URL). Install/start it, or point REDIS_URL at a running server." >&2; exit 1; }
fi

# The application database (the test database is created by pytest-django itself).
if ! psql -h "$pg_host" -p "$pg_port" -U "$pg_user" -d postgres -tAc "select 1 from pg_database where datname='$pg_db'" | grep -q 1; then
  createdb -h "$pg_host" -p "$pg_port" -U "$pg_user" "$pg_db"
  echo "Created database $pg_db"
fi
echo "PostgreSQL ($pg_host:$pg_port/$pg_db) and Redis ($redis_host:$redis_port) are up."
