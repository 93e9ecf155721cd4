-- wrk script for bench/frontend.py: GET on the URL's path (/health), counted and summarised
-- by summary.lua (beside this file) as the /predict runs are, so the two rates compare.
-- Run with -t1.

dofile((debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "summary.lua")

function init(args)
  start_counting()
end
