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

-- How many entries were logged after `since`, and the sum of their values (of `value(v)` where given).
function M.after(l, since, value)
  local n, sum = 0, 0
  if l == nil then
    return n, sum
  end
  local i = l.tail
  while i >= l.head and l.t[i] > since do
    n, sum = n + 1, sum + (value ~= nil and value(l.v[i]) or l.v[i])
    i = i - 1
  end
  return n, sum
end

-- How many entries were logged after `since` (whatever their values).
function M.count_after(l, since)
  local n = 0
  if l == nil then
    return n
  end
  local i = l.tail
  while i >= l.head and l.t[i] > since do
    n, i = n + 1, i - 1
  end
  return n
end

-- The time of the last entry, or nil.
function M.last(l)
  if l == nil or l.tail < l.head then
    return nil
  end
  return l.t[l.tail]
end

return M
