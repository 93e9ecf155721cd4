"""Writes `.env.example` from the settings class, so every knob is listed with its default."""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic.fields import FieldInfo

from api.settings import Settings

HEADER = """\
# loraserve settings: copy to `.env` and change what you need. Every setting can also be set
# in the environment (names are case-insensitive). Per-model adapter folders use the seed names
# <MODEL>_ADAPTER_DIR (e.g. EXAONE_ADAPTER_DIR for a model named "exaone"); they override that
# model's default adapter path in the models file.
"""
# Read by compose.yaml, not by the service.
STACK = """\
# --- docker compose stack (compose.yaml) ---
# Host port of the service.
API_PORT=8000
# Host port of Prometheus, and how long it keeps samples.
PROMETHEUS_PORT=9090
PROMETHEUS_RETENTION=15d
# Host port of Grafana, its admin login (change the password), and read-only anonymous access.
GRAFANA_PORT=3000
GRAFANA_ADMIN_USER=admin
GRAFANA_ADMIN_PASSWORD=admin
GRAFANA_ANONYMOUS=true
# --- profile `scale` (docker compose --profile scale up) ---
# How many replicas of the service HAProxy balances (the config has 10 slots).
API_REPLICAS=3
# torch's CPU threads in each replica (their TORCH_NUM_THREADS): the replicas share this
# host's cores, so keep it at most the cores / API_REPLICAS.
REPLICA_TORCH_NUM_THREADS=1
# Host ports of HAProxy's front door and of its stats page (/stats, /metrics).
LB_PORT=8080
LB_STATS_PORT=8404
# Redis's memory bound; past it, the least recently used answers are evicted.
REDIS_MAXMEMORY=256mb
# Redis's password, required (e.g. `openssl rand -hex 32`; hex needs no escaping in the
# replicas' REDIS_URL). The replicas also need REDIS_CACHE_SECRET (above), another such key.
# REDIS_PASSWORD=
"""
OUTPUT = Path(__file__).resolve().parents[1] / ".env.example"


def shown_default(field: FieldInfo) -> str | None:
    """A setting's default as written in `.env`; None when it is unset by default."""
    default = field.get_default(call_default_factory=True)
    if default is None:
        return None
    return str(default).lower() if isinstance(default, bool) else str(default)


def render() -> str:
    """The file's text: one commented line of description, then NAME=default."""
    lines = [HEADER]
    for name, field in Settings.model_fields.items():
        if name == "adapter_dirs":
            lines.append(f"# {field.description}\n# EXAONE_ADAPTER_DIR=/srv/adapters/exaone-spam\n")
            continue
        shown = shown_default(field)
        if shown is None:  # unset: left commented, since an empty value is not "unset"
            lines.append(f"# {field.description}\n# {name.upper()}=\n")
            continue
        lines.append(f"# {field.description}\n{name.upper()}={shown}\n")
    return "\n".join([*lines, STACK])


def main() -> int:
    """Writes the file, or with --check exits 1 when it is out of date."""
    text = render()
    if "--check" in sys.argv:
        return 0 if OUTPUT.read_text(encoding="utf-8") == text else 1
    OUTPUT.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
