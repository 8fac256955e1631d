-- triscope's per-request headroom picker inside HAProxy (2.6+, built with Lua): the decisions of
-- triscope's Endpoint Picker (exporters/epp.py, docs/epp.md) on HAProxy's own data path.
--
-- HAProxy's count of requests in flight on each server (every pool summed) is the picker's ledger:
-- exact, and no request herds onto the server that looked emptiest at the last scrape. triscope's
-- [epp] service scrapes every engine and serves what each scrape said at GET /v1/pick-table (the
-- requests the engine runs or queues, its free KV, early signs of a KV shortage, health, and the
-- weight engine's drains); a task here polls it. Per request the action estimates the KV the request
-- will hold (body bytes / chars per token + its max_tokens) and picks, among the servers HAProxy has
-- up, the one with the least work: HAProxy's requests in flight there, plus the requests the engine
-- runs that this HAProxy did not send (a pinned tenant, another LB), plus a penalty where the request
-- does not fit the free KV left after what was sent since the scrape. Ties go to a random one. A
-- server without a fresh row counts its requests in flight only (with no table: leastconn's choice);
-- with no server up the variable stays unset and the backend's own balance answers.
--
-- The table also carries the weight engine's admission level per class ([weights.levels]); as the
-- Endpoint Picker's gate (analyzers/routing/gate.py), the action refuses a share of a class at
-- `degrade`, holds it to a token bucket at `limit` (admit ratio x its arrival rate over the last
-- `win` seconds, one second of burst) and refuses all of it at `break`, by setting
-- txn.triscope_refused to the level; the rule after it answers with the fallback. With no fresh
-- table every class is admitted.
--
--   global
--       setenv TRISCOPE_PICK_TABLE_URL http://127.0.0.1:9003/v1/pick-table
--       lua-load /path/to/haproxy_pick.lua
--   backend gpus
--       balance leastconn
--       option http-buffer-request
--       http-request lua.triscope_pick gpus cpt=4,out=256,ew=1,mp=1,sp=1,vis=0.2,stale=3,size=256,win=10
--       http-request return status 503 content-type application/json string '{...}' if { var(txn.triscope_refused) -m found }
--       http-response lua.triscope_pick_end
--       use-server b0 if { var(txn.triscope_server) -m str b0 }
--       ...
--
-- First argument: every pool holding the same servers (their requests in flight add up); second:
-- the picker's settings ([epp]). `triscope weights haproxy-pick` prints these lines from the config.
-- TRISCOPE_PICK_TABLE_POLL_MS sets the poll period (default 50). Load it with lua-load (one shared
-- state, one thread at a time): with several threads, only a pick made between another's and HAProxy
-- counting that one's connection may count the same room twice. It requires the haproxy_pick_*.lua
-- modules from its own folder (time logs, class admission, counters).
--
-- Each pick leaves its factors in txn.triscope_pick_factors (NAME:BUSY+EXTERNAL:FIT:SCORE per server),
-- with txn.triscope_class and txn.triscope_need (KV tokens), for a log-format (exporters/haproxy_pick.py).

do -- the modules beside this file (haproxy_pick_*.lua), wherever it was installed
  local dir = string.match(debug.getinfo(1, "S").source, "^@(.*)/[^/]*$") or "."
  package.path = dir .. "/?.lua;" .. package.path
end
local ring = require("haproxy_pick_ring")
local admission = require("haproxy_pick_admission")
local counters = require("haproxy_pick_stats")

local URL = os.getenv("TRISCOPE_PICK_TABLE_URL")
local POLL_MS = tonumber(os.getenv("TRISCOPE_PICK_TABLE_POLL_MS") or "") or 50
-- A table larger than this is dropped unparsed (a fleet of 4,096 backends writes ~0.5 MB): what a poll
-- brings can never grow the Lua state past it, and the picker fails open as for garbage.
local MAX_TABLE_BYTES = tonumber(os.getenv("TRISCOPE_PICK_TABLE_MAX_BYTES") or "") or 1048576
local MAX_TABLE_ROWS = 10000
local KEEP_S = 10 -- pick and end times kept per server: a scrape older than this is stale anyway
local SERVER_VAR = "txn.triscope_server"
local FACTORS_VAR = "txn.triscope_pick_factors"
local CLASS_VAR = "txn.triscope_class"
local NEED_VAR = "txn.triscope_need"
local PROMPT_VAR = "txn.triscope_prompt" -- its prompt's tokens: the KV its end frees, at the least
local PICKED_VAR = "txn.triscope_picked_ms" -- when it was picked (HAProxy's variables hold integers)
local REFUSED_VAR = "txn.triscope_refused"

local rows = {} -- backend name -> what its last scrape said (times on this clock)
local rows_at = -1 -- when the table arrived
local picks = {} -- server name -> log of (time, KV tokens) of the requests picked
local ends = {} -- server name -> log of (time, { picked, need, prompt }) of the responses that came back
local sizes = { n = 0, sum = 0, i = 0, v = {} } -- the last 256 requests' KV need
local parsed = {}
local stats = counters.counts -- haproxy_pick_stats.lua says what each counts

local function now_s()
  local t = core.now()
  return t.sec + t.usec / 1e6
end


-- One table: a header line "triscope-pick-table 1", then per backend
-- NAME HEALTHY DRAINED FRESH_LEFT_S ENGINE_REQUESTS FREE_KV RESERVE KV_SHORT SCRAPE_AGE_S SENT_AGE_S DRAINED_CLASSES REFUSED
-- WAITING (the last column may be absent: a table of an older triscope)
-- (ages relative to when the table was written: no clock is shared; -1 for an unknown figure), and
-- per class "@class NAME LEVEL SHED_RATIO ADMIT_RATIO". The table was written between the poll's
-- start and its answer: each time is placed where an error counts fewer external requests (the
-- scrape's answer as late, its sending as early as possible).
local function parse_table(body, asked, arrived)
  local out, classes, header, nrows = {}, {}, false, 0
  for line in string.gmatch(body, "[^\n]+") do
    if not header then
      if string.match(line, "^triscope%-pick%-table 1") == nil then
        return nil
      end
      header = true
    else
      local f = {}
      for word in string.gmatch(line, "%S+") do
        f[#f + 1] = word
      end
      if f[1] == "@class" and #f >= 5 then
        classes[f[2]] = { level = f[3], shed = tonumber(f[4]) or 0, admit = tonumber(f[5]) or 1 }
      elseif #f >= 11 and nrows < MAX_TABLE_ROWS then
        nrows = nrows + 1
        local drains = {}
        if f[11] ~= "-" then
          for c in string.gmatch(f[11], "[^,]+") do
            drains[c] = true
          end
        end
        out[f[1]] = {
          healthy = f[2] == "1", drained = f[3] == "1", fresh_until = arrived + (tonumber(f[4]) or -1),
          load = tonumber(f[5]) or -1, free = tonumber(f[6]) or -1, reserve = tonumber(f[7]) or 0,
          short = f[8] == "1", updated = arrived - (tonumber(f[9]) or 0), sent = asked - (tonumber(f[10]) or 0),
          class_drains = drains, refused = f[12] == "1", waiting = tonumber(f[13] or "") or -1,
        }
      end
    end
  end
  if not header then
    return nil
  end
  return out, classes
end

if URL ~= nil and URL ~= "" then
  core.register_task(function()
    local client = core.httpclient()
    while true do
      local asked = now_s()
      local ok, answer = pcall(client.get, client, { url = URL, timeout = 1000 })
      local table_now, classes = nil, nil
      if ok and answer ~= nil and answer.status == 200 and answer.body ~= nil then
        if #answer.body > MAX_TABLE_BYTES then
          stats.oversized_polls = stats.oversized_polls + 1
        else
          local parsed_ok, t, c = pcall(parse_table, answer.body, asked, now_s())
          if parsed_ok then
            table_now, classes = t, c
          end
        end
      end
      answer = nil
      if table_now == nil then -- what a refused answer took is returned now, not at the next GC cycle
        collectgarbage("collect")
      end
      if table_now ~= nil then
        rows, rows_at = table_now, now_s()
        admission.set_levels(classes)
        stats.polls = stats.polls + 1
      else
        stats.failed_polls = stats.failed_polls + 1
      end
      core.msleep(POLL_MS)
    end
  end)
end

local function settings(pools_arg, params_arg)
  local key = pools_arg .. "|" .. params_arg
  local cfg = parsed[key]
  if cfg == nil then
    cfg = { pools = {}, cpt = 4, out = 256, ew = 1, mp = 1, sp = 1, vis = 0.2, stale = 3, size = 256, win = 10 }
    for pool in string.gmatch(pools_arg, "[^,]+") do
      table.insert(cfg.pools, pool)
    end
    for name, value in string.gmatch(params_arg, "([%a_]+)=([%d%.]+)") do
      cfg[name] = tonumber(value)
    end
    parsed[key] = cfg
  end
  return cfg
end

-- Requests in flight on a server over every pool holding it (sample fetches: a server's whole stats
-- table per request cost more than the rest of the action).
local function in_flight(txn, cfg, own_pool, name)
  local busy = tonumber(txn.f:srv_conn(own_pool .. "/" .. name)) or 0
  for _, pool in ipairs(cfg.pools) do
    local proxy = pool ~= own_pool and core.backends[pool] or nil
    if proxy ~= nil and proxy.servers[name] ~= nil then
      busy = busy + (tonumber(txn.f:srv_conn(pool .. "/" .. name)) or 0)
    end
  end
  return busy
end

local function mean_size(cfg)
  if sizes.n == 0 then
    return cfg.size
  end
  return sizes.sum / sizes.n
end

local function remember_size(tokens)
  sizes.i = sizes.i % 256 + 1
  local old = sizes.v[sizes.i]
  if old ~= nil then
    sizes.sum, sizes.n = sizes.sum - old, sizes.n - 1
  end
  sizes.v[sizes.i] = tokens
  sizes.sum, sizes.n = sizes.sum + tokens, sizes.n + 1
end

-- KV tokens the request will hold: prompt (body bytes / chars per token) + max_tokens (or the default);
-- and the prompt's alone.
local function request_tokens(txn, body, cfg)
  local size = math.max(#body, tonumber(txn.f:req_hdr("content-length") or "") or 0)
  if size <= 0 then
    return mean_size(cfg), 0
  end
  local out = tonumber(string.match(body, '"max_tokens"%s*:%s*(%d+)')
    or string.match(body, '"max_completion_tokens"%s*:%s*(%d+)') or "")
  if out == nil or out <= 0 then
    out = cfg.out
  end
  return size / cfg.cpt + out, size / cfg.cpt
end

-- One server's standing for this request, from HAProxy's count and its backend's row.
local function standing(busy, name, row, now, tokens, request_class, cfg)
  local s = { name = name, busy = busy, work = busy, external = 0, fits = true, strict = false, eligible = true,
    healthy = true, fresh = false }
  if row == nil then
    return s
  end
  -- an engine too busy to render /metrics in time but still answering is slow, not gone (as the
  -- Endpoint Picker's answers keep it ready); one whose port refused a scrape is gone
  local answered = ring.last(ends[name])
  s.healthy = row.healthy or (not row.refused and answered and now - answered <= cfg.stale) or false
  s.eligible = s.healthy and not row.drained and not row.class_drains[request_class]
  if now > row.fresh_until then
    return s
  end
  -- HAProxy's own requests the scrape saw: in flight now, less those picked after its answer, plus
  -- those answered after it was sent; the rest of the engine's requests came from elsewhere
  local picked_since = ring.count_after(picks[name], row.updated)
  local ended_since = ring.count_after(ends[name], row.sent)
  local external = 0
  if row.load >= 0 then
    external = math.max(0, row.load - (busy - picked_since + ended_since))
  end
  s.work, s.external, s.fresh = busy + external * cfg.ew, external, true
  s.strict = row.short or external > 0
  if row.free >= 0 then
    -- what was sent since the scrape (or just before it: not yet in its KV figure) holds KV the scrape
    -- did not see; what came back since it answered holds none now
    local _, unseen = ring.after(picks[name], row.updated - cfg.vis)
    local _, freed = ring.after(ends[name], row.updated, function(e)
      if e.picked > row.updated - cfg.vis then -- counted out as unseen above: gone, so back in
        return e.need
      end
      -- the scrape saw it hold its prompt at least, unless requests were waiting: they take freed KV
      -- first (and a request that waited held none at the scrape)
      return row.waiting == 0 and e.prompt or 0
    end)
    local free = row.short and 0 or row.free + freed - unseen
    s.fits = free - row.reserve >= tokens
  end
  return s
end

-- Every server's standing for the log, one word: NAME:BUSY+EXTERNAL:FIT:SCORE per server up, joined by
-- "|"; FIT is fit, misfit (+mp), short (+sp: an early sign of a KV shortage or requests from elsewhere),
-- nofit (fitted nowhere: work alone decided) or stale (no fresh row: HAProxy's count alone); a server
-- that was no candidate shows "out" for its score.
local function factors(up, any_fits)
  local parts = {}
  for _, s in ipairs(up) do
    local fit = "stale"
    if s.fresh then
      fit = s.fits and "fit" or (not any_fits and "nofit") or (s.strict and "short") or "misfit"
    end
    local score = s.score ~= nil and string.format("%g", s.score) or "out"
    parts[#parts + 1] = string.format("%s:%g+%g:%s:%s", s.name, s.busy, s.external, fit, score)
  end
  return table.concat(parts, "|")
end


core.register_action("triscope_pick", { "http-req" }, function(txn, pools_arg, params_arg)
  local cfg = settings(pools_arg, params_arg)
  local own_pool = txn.f:be_name()
  local own = core.backends[own_pool]
  if own == nil then
    return
  end
  local now = now_s()
  local body = txn.f:req_body() or ""
  local tokens, prompt_tokens = request_tokens(txn, body, cfg)
  local request_class = txn.f:req_hdr("x-triscope-class")
  if request_class == nil then -- as the Endpoint Picker: the header, else the body's request_class
    request_class = string.match(body, '"request_class"%s*:%s*"([^"]*)"') or ""
  end
  local table_ok = rows_at >= 0 and now - rows_at <= cfg.stale
  local refused = admission.refusal(request_class, now, cfg.win, table_ok)
  if refused ~= nil then
    stats["refused_" .. refused] = stats["refused_" .. refused] + 1
    txn:set_var(REFUSED_VAR, refused)
    return
  end
  local up = {}
  for name, srv in pairs(own.servers) do
    if (tonumber(srv:get_weight()) or 0) > 0 and txn.f:srv_is_up(own_pool .. "/" .. name) then
      local busy = in_flight(txn, cfg, own_pool, name)
      up[#up + 1] = standing(busy, name, table_ok and rows[name] or nil, now, tokens, request_class, cfg)
    end
  end
  local candidates = {}
  for _, s in ipairs(up) do
    if s.eligible then
      candidates[#candidates + 1] = s
    end
  end
  if #candidates == 0 then -- every one drained or unready: the least bad, as the Endpoint Picker does
    for _, s in ipairs(up) do
      if s.healthy then
        candidates[#candidates + 1] = s
      end
    end
  end
  if #candidates == 0 then
    stats.fallback = stats.fallback + 1
    return
  end
  local any_fits, least_busy = false, nil
  for _, s in ipairs(candidates) do
    any_fits = any_fits or s.fits
    least_busy = math.min(least_busy or s.busy, s.busy)
  end
  local best, ties = nil, {}
  for _, s in ipairs(candidates) do
    local score = s.work
    if any_fits and not s.fits then
      score = score + (s.strict and cfg.sp or cfg.mp)
    end
    s.score = score
    if best == nil or score < best - 1e-9 then
      best, ties = score, { s }
    elseif score <= best + 1e-9 then
      ties[#ties + 1] = s
    end
  end
  local pick = ties[math.random(#ties)]
  local chosen = pick.name
  if #candidates < #up then
    stats.excluded = stats.excluded + 1
  end
  if not table_ok then
    stats.no_table = stats.no_table + 1
  end
  if not any_fits then
    stats.no_fit = stats.no_fit + 1
  end
  if pick.busy > least_busy then
    stats.diverted = stats.diverted + 1
  end
  ring.push(ring.log_for(picks, chosen), now, tokens, KEEP_S)
  remember_size(tokens)
  stats.picks = stats.picks + 1
  txn:set_var(SERVER_VAR, chosen)
  txn:set_var(FACTORS_VAR, factors(up, any_fits))
  txn:set_var(CLASS_VAR, (string.gsub(request_class, "[^%w_%.%-]", "_"))) -- one word in the log
  txn:set_var(NEED_VAR, math.floor(tokens + 0.5))
  txn:set_var(PROMPT_VAR, math.floor(prompt_tokens))
  txn:set_var(PICKED_VAR, math.floor(now * 1000))
end, 2)

core.register_action("triscope_pick_end", { "http-res" }, function(txn)
  local name = txn:get_var(SERVER_VAR)
  if name ~= nil and (tonumber(txn.sf:status()) or 500) < 500 then -- the engine answered: it serves
    local ended = { picked = (tonumber(txn:get_var(PICKED_VAR)) or 0) / 1000,
      need = tonumber(txn:get_var(NEED_VAR)) or 0, prompt = tonumber(txn:get_var(PROMPT_VAR)) or 0 }
    ring.push(ring.log_for(ends, name), now_s(), ended, KEEP_S)
  end
end, 0)

counters.register(function()
  return rows_at >= 0 and now_s() - rows_at or nil
end)
