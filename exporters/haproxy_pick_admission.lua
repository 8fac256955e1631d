-- Class admission for triscope's picker inside HAProxy (haproxy_pick.lua), with the Endpoint Picker's
-- rules (analyzers/routing/gate.py): the weight engine's level per class arrives with each pick table;
-- `degrade` refuses a share of the class, `limit` holds it to a token bucket (admit ratio x its arrival
-- rate over the last `win` seconds, BURST_S seconds of burst), `break` refuses all of it.

local ring = require("haproxy_pick_ring")

local M = {}
local BURST_S = 1 -- a limited class's bucket holds this many seconds of its rate (as the gate's)
local levels = {} -- class -> { level, shed, admit } from the table
local arrivals = {} -- class -> log of arrival times (only classes the table names: bounded)
local buckets = {} -- class -> token bucket while the class is at `limit`

-- The levels of a new table; a class leaving `limit` starts afresh next time (as the gate).
function M.set_levels(classes)
  levels = classes
  for name, _ in pairs(buckets) do
    if levels[name] == nil or levels[name].level ~= "limit" then
      buckets[name] = nil
    end
  end
end

-- The level that refuses this request of `request_class`, or nil. Every request of a class the table
-- names counts toward its arrival rate; with no fresh table (`table_ok` false) every class is admitted.
function M.refusal(request_class, now, win, table_ok)
  local level = levels[request_class]
  if level == nil then
    return nil
  end
  local log = ring.log_for(arrivals, request_class)
  ring.trim(log, now - win)
  local seen = log.tail - log.head + 1
  ring.push(log, now, 1, win)
  if not table_ok then
    return nil
  end
  if level.level == "break" then
    return "break"
  end
  if (level.level == "degrade" or level.level == "limit") and level.shed > 0 and math.random() < level.shed then
    return "degrade"
  end
  if level.level ~= "limit" then
    return nil
  end
  local rate = level.admit * (seen + 1) / win
  local capacity = math.max(1, rate * BURST_S)
  local bucket = buckets[request_class]
  if bucket == nil then -- the limit starts with a full bucket
    bucket = { tokens = capacity, at = now }
    buckets[request_class] = bucket
  end
  bucket.tokens = math.min(capacity, bucket.tokens + (now - bucket.at) * rate)
  bucket.at = now
  if bucket.tokens >= 1 then
    bucket.tokens = bucket.tokens - 1
    return nil
  end
  return "limit"
end

return M
