-- wrk script: POST /predict, cycling through the JSON bodies in the file named by BODIES
-- (one per line), and print a JSON summary from done() for the Python driver to read.
local bodies = {}
local next_body = 1

function init(args)
  for line in io.lines(os.getenv("BODIES")) do
    bodies[#bodies + 1] = line
  end
end

function request()
  local body = bodies[next_body]
  next_body = next_body % #bodies + 1
  return wrk.format("POST", "/predict", { ["Content-Type"] = "application/json" }, body)
end

function done(summary, latency, requests)
  local errors = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "non_2xx": %d, "socket_errors": %d, ' ..
    '"p50_us": %d, "p99_us": %d, "max_us": %d}\n',
    summary.requests, summary.duration, errors.status,
    errors.connect + errors.read + errors.write + errors.timeout,
    latency:percentile(50), latency:percentile(99), latency.max))
end
