-- wrk script for bench/throughput.py: POST /predict, cycling through the JSON bodies in the
-- file named by the BODIES environment variable (one body a line). Counting and the JSON line
-- done() prints come from summary.lua, beside this file. Run with -t1.

dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "summary.lua")

function init(args)
  bodies = {}
  for line in io.lines(os.getenv("BODIES")) do
    bodies[#bodies + 1] = line
  end
  -- Threads (if more than one) start at different places in the list.
  next_body = (id * 997) % #bodies + 1
  start_counting()
end

function request()
  local body = bodies[next_body]
  next_body = next_body % #bodies + 1
  return wrk.format("POST", "/predict", { ["Content-Type"] = "application/json" }, body)
end
