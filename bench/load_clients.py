"""Closed-loop HTTP clients in a process of their own: the client side of bench.gpu's load
points. Run as `python -m bench.load_clients`, it reads one job as JSON on standard input and
writes what came back as JSON on standard output.

Why processes: httpx's connection pool slows down as connections grow in one event loop. From
one process, 128 clients got 47 texts/s from a server that answered wrk's 128 connections at
1,650 a second (both on this repository's simulated device, 10 ms a batch), and on an H200 the
same client had capped the GPU benchmark's throughput near 280 texts/s, at every client count
from 8 up. So a load point spreads its clients over processes of at most `CLIENTS_PER_PROCESS`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any, TypedDict

import httpx

CLIENTS_PER_PROCESS = 16


class Job(TypedDict):
    """One process's share of a load point. Times are the wall clock's (`time.time()`), so
    that every process starts, stops counting the warm-up and ends together."""

    url: str
    model: str
    texts: list[str]
    first: int  # this process's first client number; client n sends texts n, n + total, ...
    clients: int
    total: int
    begin: float
    counted_from: float
    until: float


class Result(TypedDict):
    """What the counted requests of one process got back."""

    statuses: dict[str, int]
    latencies_ms: list[float]
    answered_by: dict[str, int]
    ended: float  # wall clock when its last request came back


async def drive(job: Job) -> Result:
    result = Result(statuses={}, latencies_ms=[], answered_by={}, ended=0.0)
    limits = httpx.Limits(max_connections=job["clients"], max_keepalive_connections=job["clients"])
    async with httpx.AsyncClient(base_url=job["url"], timeout=60, limits=limits) as client:
        loop = asyncio.get_running_loop()
        wall = time.time() - loop.time()  # add to a loop time for the wall clock's
        counted_from, until = job["counted_from"] - wall, job["until"] - wall
        await asyncio.sleep(max(0.0, job["begin"] - wall - loop.time()))

        async def one_client(number: int) -> None:
            sent = number
            texts = job["texts"]
            while loop.time() < until:
                body = {"inputs": texts[sent % len(texts)], "model": job["model"], "cache": False}
                sent += job["total"]
                began = loop.time()
                response = await client.post("/predict", json=body)
                if began < counted_from:
                    continue
                code = str(response.status_code)
                result["statuses"][code] = result["statuses"].get(code, 0) + 1
                if response.status_code == 200:
                    result["latencies_ms"].append((loop.time() - began) * 1000)
                    who = response.headers.get("X-Answered-By", job["model"])
                    result["answered_by"][who] = result["answered_by"].get(who, 0) + 1
                elif response.status_code == 429:
                    await asyncio.sleep(float(response.headers.get("Retry-After", "0.05")))

        first = job["first"]
        await asyncio.gather(*(one_client(n) for n in range(first, first + job["clients"])))
        result["ended"] = loop.time() + wall
    return result


def main() -> int:
    job: Job = json.load(sys.stdin)
    result: dict[str, Any] = dict(asyncio.run(drive(job)))
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
