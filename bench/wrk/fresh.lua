-- wrk script for bench/throughput.py's overload runs: POST /predict, each request TEXTS_PER
-- texts never sent before, so that no cache tier can answer and the model does all the work.
-- TEXTS names a file of JSON string literals, one a line ("...", escaped as JSON); each text
-- of a request is one of them with a prefix that no run repeats ("<RUN>.<request>.<i> ",
-- RUN from the environment, new each run, so no cache holds a warm-up's texts). Counting
-- (429s without a Retry-After header included) and the JSON line done() prints come from
-- summary.lua, beside this file. Run with -t1.

dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "summary.lua")

function init(args)
  texts = {}
  for line in io.lines(os.getenv("TEXTS")) do
    texts[#texts + 1] = line
  end
  per = tonumber(os.getenv("TEXTS_PER"))
  run = os.getenv("RUN")
  sent = 0
  start_counting()
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
