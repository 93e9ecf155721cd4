-- What predict.lua and fresh.lua share: wrk's setup/response/done callbacks. done() prints one
-- JSON line for bench/throughput.py: request count, duration, latency percentiles (every
-- answer), counts per HTTP status, socket errors, how many answers came from the in-process
-- LRU, and how many 429s came without a Retry-After header.
--
-- Run with -t1: every connection then lives in one Lua state, whose counters done() reads
-- through thread:get (done() itself runs in a state of its own).

local threads = {}

function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
end

-- Called from each script's init(): the counters response() adds to.
function start_counting()
  statuses = {}
  lru_hits = 0
  no_retry_after = 0
end

function response(status, headers, body)
  local key = tostring(status)
  statuses[key] = (statuses[key] or 0) + 1
  local tier = headers["x-cache"] or headers["X-Cache"] or ""
  if string.sub(tier, 1, 6) == "lru=1," then
    lru_hits = lru_hits + 1
  end
  if status == 429 and not (headers["retry-after"] or headers["Retry-After"]) then
    no_retry_after = no_retry_after + 1
  end
end

function done(summary, latency, requests)
  local counts = {}
  local hits, missing = 0, 0
  for _, thread in ipairs(threads) do
    for status, count in pairs(thread:get("statuses") or {}) do
      counts[status] = (counts[status] or 0) + count
    end
    hits = hits + (thread:get("lru_hits") or 0)
    missing = missing + (thread:get("no_retry_after") or 0)
  end
  local parts = {}
  for status, count in pairs(counts) do
    parts[#parts + 1] = string.format('"%s": %d', status, count)
  end
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "statuses": {%s}, "lru_hits": %d, ' ..
    '"no_retry_after": %d, ' ..
    '"socket_errors": {"connect": %d, "read": %d, "write": %d, "timeout": %d}, ' ..
    '"latency_us": {"mean": %.1f, "p50": %d, "p90": %d, "p99": %d, "max": %d}}\n',
    summary.requests, summary.duration, table.concat(parts, ", "), hits, missing,
    e.connect, e.read, e.write, e.timeout,
    latency.mean, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max))
end
