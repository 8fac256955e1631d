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
-- counting that one's connection may count the same room twice.

local URL = os.getenv("TRISCOPE_PICK_TABLE_URL")
local POLL_MS = tonumber(os.getenv("TRISCOPE_PICK_TABLE_POLL_MS") or "") or 50
local KEEP_S = 10 -- pick and end times kept per server: a scrape older than this is stale anyway
local SERVER_VAR = "txn.triscope_server"
local FACTORS_VAR = "txn.triscope_pick_factors"
local CLASS_VAR = "txn.triscope_class"
local NEED_VAR = "txn.triscope_need"
local REFUSED_VAR = "txn.triscope_refused"
local BURST_S = 1 -- a limited class's bucket holds this many seconds of its rate (as the gate's)

local rows = {} -- backend name -> what its last scrape said (times on this clock)
local rows_at = -1 -- when the table arrived
local picks = {} -- server name -> log of (time, KV tokens) of the requests picked
local ends = {} -- server name -> log of (time, 1) of the responses that came back
local sizes = { n = 0, sum = 0, i = 0, v = {} } -- the last 256 requests' KV need
local levels = {} -- class -> { level, shed, admit } from the table
local arrivals = {} -- class -> log of arrival times (only classes the table names: bounded)
local buckets = {} -- class -> token bucket while the class is at `limit`
local parsed = {}
-- picks: chosen by the action; fallback: left to the balance (no server up); excluded: a server up
-- in HAProxy was left out (drained, unhealthy, closed to the class); no_table: no table fresh enough;
-- no_fit: the request fitted nowhere (work alone decided); diverted: the chosen server had more of
-- HAProxy's requests in flight than the least loaded candidate (where leastconn would not have sent it)
-- refused_*: requests an admission level refused (answered by the fallback rule)
local stats = { polls = 0, failed_polls = 0, picks = 0, fallback = 0, excluded = 0, no_table = 0, no_fit = 0,
  diverted = 0, refused_degrade = 0, refused_limit = 0, refused_break = 0 }
local STAT_KEYS = { "polls", "failed_polls", "picks", "fallback", "excluded", "no_table", "no_fit", "diverted",
  "refused_degrade", "refused_limit", "refused_break" }

local function now_s()
  local t = core.now()
  return t.sec + t.usec / 1e6
end

local function log_for(logs, name)
  local l = logs[name]
  if l == nil then
    l = { t = {}, v = {}, head = 1, tail = 0 }
    logs[name] = l
  end
  return l
end

local function trim(l, horizon)
  while l.head <= l.tail and l.t[l.head] < horizon do
    l.t[l.head], l.v[l.head] = nil, nil
    l.head = l.head + 1
  end
end

local function push(l, t, v, keep)
  l.tail = l.tail + 1
  l.t[l.tail], l.v[l.tail] = t, v
  trim(l, t - (keep or KEEP_S))
end

-- How many entries were logged after `since`, and their values' sum.
local function after(l, since)
  local n, sum = 0, 0
  if l == nil then
    return n, sum
  end
  local i = l.tail
  while i >= l.head and l.t[i] > since do
    n, sum = n + 1, sum + l.v[i]
    i = i - 1
  end
  return n, sum
end

-- One table: a header line "triscope-pick-table 1", then per backend
-- NAME HEALTHY DRAINED FRESH_LEFT_S ENGINE_REQUESTS FREE_KV RESERVE KV_SHORT SCRAPE_AGE_S SENT_AGE_S DRAINED_CLASSES REFUSED
-- (ages relative to when the table was written: no clock is shared; -1 for an unknown figure), and
-- per class "@class NAME LEVEL SHED_RATIO ADMIT_RATIO". The table was written between the poll's
-- start and its answer: each time is placed where an error counts fewer external requests (the
-- scrape's answer as late, its sending as early as possible).
local function parse_table(body, asked, arrived)
  local out, classes, header = {}, {}, false
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
      elseif #f >= 11 then
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
          class_drains = drains, refused = f[12] == "1",
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
        table_now, classes = parse_table(answer.body, asked, now_s())
      end
      if table_now ~= nil then
        rows, rows_at, levels = table_now, now_s(), classes
        for name, _ in pairs(buckets) do -- a class leaving `limit` starts afresh next time (as the gate)
          if levels[name] == nil or levels[name].level ~= "limit" then
            buckets[name] = nil
          end
        end
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

-- KV tokens the request will hold: prompt (body bytes / chars per token) + max_tokens (or the default).
local function request_tokens(txn, body, cfg)
  local size = math.max(#body, tonumber(txn.f:req_hdr("content-length") or "") or 0)
  if size <= 0 then
    return mean_size(cfg)
  end
  local out = tonumber(string.match(body, '"max_tokens"%s*:%s*(%d+)')
    or string.match(body, '"max_completion_tokens"%s*:%s*(%d+)') or "")
  if out == nil or out <= 0 then
    out = cfg.out
  end
  return size / cfg.cpt + out
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
  local answered = ends[name] ~= nil and ends[name].tail >= ends[name].head and ends[name].t[ends[name].tail]
  s.healthy = row.healthy or (not row.refused and answered and now - answered <= cfg.stale) or false
  s.eligible = s.healthy and not row.drained and not row.class_drains[request_class]
  if now > row.fresh_until then
    return s
  end
  -- HAProxy's own requests the scrape saw: in flight now, less those picked after its answer, plus
  -- those answered after it was sent; the rest of the engine's requests came from elsewhere
  local picked_since = after(picks[name], row.updated)
  local ended_since = after(ends[name], row.sent)
  local external = 0
  if row.load >= 0 then
    external = math.max(0, row.load - (busy - picked_since + ended_since))
  end
  s.work, s.external, s.fresh = busy + external * cfg.ew, external, true
  s.strict = row.short or external > 0
  if row.free >= 0 then
    local _, unseen = after(picks[name], row.updated - cfg.vis)
    local free = row.short and 0 or row.free - unseen
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

-- The level that refuses this request of `request_class`, or nil (analyzers/routing/gate.py's rules).
local function refusal(request_class, now, cfg, table_ok)
  local level = levels[request_class]
  if level == nil then
    return nil
  end
  local log = log_for(arrivals, request_class)
  trim(log, now - cfg.win)
  local seen = log.tail - log.head + 1
  push(log, now, 1, cfg.win)
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
  local rate = level.admit * (seen + 1) / cfg.win
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

core.register_action("triscope_pick", { "http-req" }, function(txn, pools_arg, params_arg)
  local cfg = settings(pools_arg, params_arg)
  local own_pool = txn.f:be_name()
  local own = core.backends[own_pool]
  if own == nil then
    return
  end
  local now = now_s()
  local body = txn.f:req_body() or ""
  local tokens = request_tokens(txn, body, cfg)
  local request_class = txn.f:req_hdr("x-triscope-class")
  if request_class == nil then -- as the Endpoint Picker: the header, else the body's request_class
    request_class = string.match(body, '"request_class"%s*:%s*"([^"]*)"') or ""
  end
  local table_ok = rows_at >= 0 and now - rows_at <= cfg.stale
  local refused = refusal(request_class, now, cfg, table_ok)
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
  push(log_for(picks, chosen), now, tokens)
  remember_size(tokens)
  stats.picks = stats.picks + 1
  txn:set_var(SERVER_VAR, chosen)
  txn:set_var(FACTORS_VAR, factors(up, any_fits))
  txn:set_var(CLASS_VAR, (string.gsub(request_class, "[^%w_%.%-]", "_"))) -- one word in the log
  txn:set_var(NEED_VAR, math.floor(tokens + 0.5))
end, 2)

core.register_action("triscope_pick_end", { "http-res" }, function(txn)
  local name = txn:get_var(SERVER_VAR)
  if name ~= nil and (tonumber(txn.sf:status()) or 500) < 500 then -- the engine answered: it serves
    push(log_for(ends, name), now_s(), 1)
  end
end, 0)

-- Prometheus names of the counters (docs/epp.md); refused_* become one family with a level label.
local PROM = {
  { "polls", "triscope_haproxy_pick_table_polls_total", "Polls of the pick table that brought a table." },
  { "failed_polls", "triscope_haproxy_pick_table_poll_failures_total", "Polls of the pick table that failed." },
  { "picks", "triscope_haproxy_picks_total", "Requests whose server the action chose." },
  { "fallback", "triscope_haproxy_pick_fallbacks_total", "Requests left to the backend's balance (no server up)." },
  { "excluded", "triscope_haproxy_pick_excluded_total", "Picks that left out a server HAProxy had up." },
  { "no_table", "triscope_haproxy_pick_no_table_total", "Picks made without a fresh table." },
  { "no_fit", "triscope_haproxy_pick_no_fit_total", "Picks of a request that fitted no server's free KV." },
  { "diverted", "triscope_haproxy_pick_diverted_total", "Picks of a server busier in HAProxy than another candidate." },
}

local function prometheus_text()
  local out = {}
  for _, m in ipairs(PROM) do
    out[#out + 1] = string.format("# HELP %s %s\n# TYPE %s counter\n%s %d\n", m[2], m[3], m[2], m[2], stats[m[1]])
  end
  out[#out + 1] = "# HELP triscope_haproxy_pick_refused_total Requests refused by their class's admission level.\n"
    .. "# TYPE triscope_haproxy_pick_refused_total counter\n"
  for _, level in ipairs({ "degrade", "limit", "break" }) do
    out[#out + 1] = string.format('triscope_haproxy_pick_refused_total{level="%s"} %d\n', level, stats["refused_" .. level])
  end
  if rows_at >= 0 then
    out[#out + 1] = string.format("# HELP triscope_haproxy_pick_table_age_seconds Age of the last table polled.\n"
      .. "# TYPE triscope_haproxy_pick_table_age_seconds gauge\ntriscope_haproxy_pick_table_age_seconds %.3f\n",
      now_s() - rows_at)
  end
  return table.concat(out)
end

-- GET on a `http-request use-service lua.triscope_pick_stats` frontend: the picker's counters, as JSON,
-- or in Prometheus' text format on /metrics.
core.register_service("triscope_pick_stats", "http", function(applet)
  local body, content_type
  if applet.path == "/metrics" then
    body, content_type = prometheus_text(), "text/plain; version=0.0.4"
  else
    local parts = {}
    for _, key in ipairs(STAT_KEYS) do
      parts[#parts + 1] = string.format('"%s": %d', key, stats[key])
    end
    local age = rows_at >= 0 and string.format("%.3f", now_s() - rows_at) or "null"
    body, content_type = "{" .. table.concat(parts, ", ") .. ', "table_age_s": ' .. age .. "}\n", "application/json"
  end
  applet:set_status(200)
  applet:add_header("content-type", content_type)
  applet:add_header("content-length", tostring(#body))
  applet:start_response()
  applet:send(body)
end)
