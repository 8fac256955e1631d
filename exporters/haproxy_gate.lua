-- triscope's per-request batch gate for HAProxy (2.6+, built with Lua).
--
-- The feed's agent closes a backend to a request class from scraped gauges, which lag a burst by
-- a scrape, an engine update and an agent-check interval. This action applies the class's batch
-- limit ([weights.classes.CLASS] admit_batch_ratio x [weights.backends.NAME] max_num_seqs) to
-- every request at once, on HAProxy's own count of requests in flight on each backend (all class
-- pools summed): a backend is eligible while that count is below its limit and the agent has it
-- up with a weight above 0. Among the eligible backends it picks the one with the fewest
-- requests in flight per unit of weight, and stores its name in txn.triscope_server; with none
-- eligible the variable stays unset (answer 503: the class is shed at once).
--
--   global
--       lua-load /path/to/haproxy_gate.lua
--   backend pool_offline_video
--       http-request lua.triscope_gate pool_a,pool_b,pool_offline_video b0=6,b1=6,b3=3
--       http-request deny deny_status 503 if !{ var(txn.triscope_server) -m found }
--       use-server b0 if { var(txn.triscope_server) -m str b0 }
--       ...
--
-- First argument: every pool holding the same servers (their in-flight requests add up);
-- second: NAME=LIMIT per server, comma-separated (a server without one, or '-' for none, is
-- only subject to the agent). `triscope weights haproxy-gate` prints these lines from the config.
-- The count is exact when one single-threaded HAProxy process fronts the backends (tested so);
-- with several threads, requests picked at the same instant may each pass the limit once, and
-- several load balancers each see only their own share.

local parsed = {}

local function parse(pools_arg, limits_arg)
  local key = pools_arg .. "|" .. limits_arg
  local cfg = parsed[key]
  if cfg == nil then
    cfg = { pools = {}, limits = {} }
    for pool in string.gmatch(pools_arg, "[^,]+") do
      table.insert(cfg.pools, pool)
    end
    for name, limit in string.gmatch(limits_arg, "([^,=]+)=([%d%.]+)") do
      cfg.limits[name] = tonumber(limit)
    end
    parsed[key] = cfg
  end
  return cfg
end

local function in_flight(cfg, name)
  local busy = 0
  for _, pool in ipairs(cfg.pools) do
    local proxy = core.backends[pool]
    local srv = proxy and proxy.servers[name]
    if srv ~= nil then
      busy = busy + (tonumber(srv:get_stats().scur) or 0)
    end
  end
  return busy
end

core.register_action("triscope_gate", { "http-req" }, function(txn, pools_arg, limits_arg)
  local cfg = parse(pools_arg, limits_arg)
  local own = core.backends[txn.f:be_name()]
  if own == nil then
    return
  end
  local best, best_score = nil, nil
  for name, srv in pairs(own.servers) do
    local st = srv:get_stats()
    local weight = tonumber(st.weight) or 0
    local status = st.status or ""
    if weight > 0 and (string.sub(status, 1, 2) == "UP" or status == "no check") then
      local busy = in_flight(cfg, name)
      local limit = cfg.limits[name]
      if limit == nil or busy < limit then
        local score = (busy + 1) / weight
        if best_score == nil or score < best_score or (score == best_score and name < best) then
          best, best_score = name, score
        end
      end
    end
  end
  if best ~= nil then
    txn:set_var("txn.triscope_server", best)
  end
end, 2)
