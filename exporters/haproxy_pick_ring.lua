-- Time-stamped logs for triscope's picker inside HAProxy (haproxy_pick.lua): per key, a queue of
-- (time, value) entries, trimmed from the old end as new ones arrive, so memory stays bounded by what
-- the last seconds held.

local M = {}

-- The log of `name` in `logs`, made empty on first use.
function M.log_for(logs, name)
  local l = logs[name]
  if l == nil then
    l = { t = {}, v = {}, head = 1, tail = 0 }
    logs[name] = l
  end
  return l
end

-- Drop the entries older than `horizon`.
function M.trim(l, horizon)
  while l.head <= l.tail and l.t[l.head] < horizon do
    l.t[l.head], l.v[l.head] = nil, nil
    l.head = l.head + 1
  end
end

-- Append (t, v) and keep the last `keep` seconds.
function M.push(l, t, v, keep)
  l.tail = l.tail + 1
  l.t[l.tail], l.v[l.tail] = t, v
  M.trim(l, t - keep)
end

-- The index of the oldest entry logged after `since` (tail + 1 when none): entries are in time order.
local function first_after(l, since)
  local i = l.tail
  while i >= l.head and l.t[i] > since do
    i = i - 1
  end
  return i + 1
end

-- How many entries were logged after `since`, and the sum of their values (of `value(v)` where given).
function M.after(l, since, value)
  if l == nil then
    return 0, 0
  end
  local first, sum = first_after(l, since), 0
  for i = first, l.tail do
    sum = sum + (value ~= nil and value(l.v[i]) or l.v[i])
  end
  return l.tail - first + 1, sum
end

-- How many entries were logged after `since` (whatever their values).
function M.count_after(l, since)
  if l == nil then
    return 0
  end
  return l.tail - first_after(l, since) + 1
end

-- The time of the last entry, or nil.
function M.last(l)
  if l == nil or l.tail < l.head then
    return nil
  end
  return l.t[l.tail]
end

return M
