-- wrk script for bench/throughput.py: POST /predict, cycling through the JSON bodies in the
-- file named by the BODIES environment variable (one body a line), and print one JSON line
-- from done() for the Python driver: request count, duration, latency percentiles, counts per
-- HTTP status, socket errors, and how many answers came from the in-process LRU.
--
-- Run with -t1: every connection then lives in one Lua state, whose counters done() reads
-- through thread:get (done() itself runs in a state of its own).

local threads = {}

function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
end

function init(args)
  bodies = {}
  for line in io.lines(os.getenv("BODIES")) do
    bodies[#bodies + 1] = line
  end
  -- Threads (if more than one) start at different places in the list.
  next_body = (id * 997) % #bodies + 1
  statuses = {}
  lru_hits = 0
end

function request()
  local body = bodies[next_body]
  next_body = next_body % #bodies + 1
  return wrk.format("POST", "/predict", { ["Content-Type"] = "application/json" }, body)
end

function response(status, headers, body)
  local key = tostring(status)
  statuses[key] = (statuses[key] or 0) + 1
  local tier = headers["x-cache"] or headers["X-Cache"] or ""
  if string.sub(tier, 1, 6) == "lru=1," then
    lru_hits = lru_hits + 1
  end
end

function done(summary, latency, requests)
  local counts = {}
  local hits = 0
  for _, thread in ipairs(threads) do
    for status, count in pairs(thread:get("statuses") or {}) do
      counts[status] = (counts[status] or 0) + count
    end
    hits = hits + (thread:get("lru_hits") or 0)
  end
  local parts = {}
  for status, count in pairs(counts) do
    parts[#parts + 1] = string.format('"%s": %d', status, count)
  end
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "statuses": {%s}, "lru_hits": %d, ' ..
    '"socket_errors": {"connect": %d, "read": %d, "write": %d, "timeout": %d}, ' ..
    '"latency_us": {"mean": %.1f, "p50": %d, "p90": %d, "p99": %d, "max": %d}}\n',
    summary.requests, summary.duration, table.concat(parts, ", "), hits,
    e.connect, e.read, e.write, e.timeout,
    latency.mean, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max))
end
