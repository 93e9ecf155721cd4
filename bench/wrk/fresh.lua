-- wrk script for bench/throughput.py's overload runs: POST /predict, each request TEXTS_PER
-- texts never sent before, so that no cache tier can answer and the model does all the work.
-- TEXTS names a file of JSON string literals, one a line ("...", escaped as JSON); each text
-- of a request is one of them with a prefix that no run repeats ("<RUN>.<request>.<i> ",
-- RUN from the environment, new each run, so no cache holds a warm-up's texts). done() prints
-- one JSON line for the Python driver: request count, duration, latency percentiles (all
-- answers), counts per HTTP status, and 429s that came without a Retry-After header.
--
-- Run with -t1 (one Lua state for every connection; done() reads it through thread:get).

local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  texts = {}
  for line in io.lines(os.getenv("TEXTS")) do
    texts[#texts + 1] = line
  end
  per = tonumber(os.getenv("TEXTS_PER"))
  run = os.getenv("RUN")
  sent = 0
  statuses = {}
  no_retry_after = 0
end

function request()
  sent = sent + 1
  local parts = {}
  for i = 1, per do
    local literal = texts[((sent - 1) * per + i - 1) % #texts + 1]
    -- '"text"' becomes '"<run>.<sent>.<i> text"': still one JSON string, now unique.
    parts[i] = '"' .. run .. "." .. sent .. "." .. i .. " " .. string.sub(literal, 2)
  end
  local body = '{"inputs": [' .. table.concat(parts, ", ") .. ']}'
  return wrk.format("POST", "/predict", { ["Content-Type"] = "application/json" }, body)
end

function response(status, headers, body)
  local key = tostring(status)
  statuses[key] = (statuses[key] or 0) + 1
  if status == 429 and not (headers["retry-after"] or headers["Retry-After"]) then
    no_retry_after = no_retry_after + 1
  end
end

function done(summary, latency, requests)
  local counts = {}
  local missing = 0
  for _, thread in ipairs(threads) do
    for status, count in pairs(thread:get("statuses") or {}) do
      counts[status] = (counts[status] or 0) + count
    end
    missing = missing + (thread:get("no_retry_after") or 0)
  end
  local parts = {}
  for status, count in pairs(counts) do
    parts[#parts + 1] = string.format('"%s": %d', status, count)
  end
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "statuses": {%s}, "no_retry_after": %d, ' ..
    '"socket_errors": {"connect": %d, "read": %d, "write": %d, "timeout": %d}, ' ..
    '"latency_us": {"mean": %.1f, "p50": %d, "p90": %d, "p99": %d, "max": %d}}\n',
    summary.requests, summary.duration, table.concat(parts, ", "), missing,
    e.connect, e.read, e.write, e.timeout,
    latency.mean, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max))
end
