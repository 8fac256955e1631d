-- The counters of triscope's picker inside HAProxy (haproxy_pick.lua) and the service that answers them,
-- as JSON or in Prometheus' text format.
--
-- picks: chosen by the action; fallback: left to the balance (no server up); excluded: a server up
-- in HAProxy was left out (drained, unhealthy, closed to the class); no_table: no table fresh enough;
-- no_fit: the request fitted nowhere (work alone decided); diverted: the chosen server had more of
-- HAProxy's requests in flight than the least loaded candidate (where leastconn would not have sent it)
-- refused_*: requests an admission level refused (answered by the fallback rule); oversized_polls: answers
-- larger than the table bound, dropped unparsed (counted in failed_polls too)

local M = {}
M.KEYS = { "polls", "failed_polls", "oversized_polls", "picks", "fallback", "excluded", "no_table", "no_fit", "diverted",
  "refused_degrade", "refused_limit", "refused_break" }
M.counts = {}
for _, key in ipairs(M.KEYS) do
  M.counts[key] = 0
end

-- Prometheus names of the counters (docs/epp.md); refused_* become one family with a level label.
local PROM = {
  { "polls", "triscope_haproxy_pick_table_polls_total", "Polls of the pick table that brought a table." },
  { "failed_polls", "triscope_haproxy_pick_table_poll_failures_total", "Polls of the pick table that failed." },
  { "oversized_polls", "triscope_haproxy_pick_table_oversized_total",
    "Polls whose answer was larger than TRISCOPE_PICK_TABLE_MAX_BYTES (not parsed; also failures)." },
  { "picks", "triscope_haproxy_picks_total", "Requests whose server the action chose." },
  { "fallback", "triscope_haproxy_pick_fallbacks_total", "Requests left to the backend's balance (no server up)." },
  { "excluded", "triscope_haproxy_pick_excluded_total", "Picks that left out a server HAProxy had up." },
  { "no_table", "triscope_haproxy_pick_no_table_total", "Picks made without a fresh table." },
  { "no_fit", "triscope_haproxy_pick_no_fit_total", "Picks of a request that fitted no server's free KV." },
  { "diverted", "triscope_haproxy_pick_diverted_total", "Picks of a server busier in HAProxy than another candidate." },
}

local function prometheus_text(age)
  local out = {}
  for _, m in ipairs(PROM) do
    out[#out + 1] = string.format("# HELP %s %s\n# TYPE %s counter\n%s %d\n", m[2], m[3], m[2], m[2], M.counts[m[1]])
  end
  out[#out + 1] = "# HELP triscope_haproxy_pick_refused_total Requests refused by their class's admission level.\n"
    .. "# TYPE triscope_haproxy_pick_refused_total counter\n"
  for _, level in ipairs({ "degrade", "limit", "break" }) do
    out[#out + 1] = string.format('triscope_haproxy_pick_refused_total{level="%s"} %d\n', level, M.counts["refused_" .. level])
  end
  if age ~= nil then
    out[#out + 1] = string.format("# HELP triscope_haproxy_pick_table_age_seconds Age of the last table polled.\n"
      .. "# TYPE triscope_haproxy_pick_table_age_seconds gauge\ntriscope_haproxy_pick_table_age_seconds %.3f\n",
      age)
  end
  return table.concat(out)
end

-- GET on a `http-request use-service lua.triscope_pick_stats` frontend: the picker's counters, as JSON,
-- or in Prometheus' text format on /metrics; `table_age_s()` says how old the last table is (nil: none yet).
function M.register(table_age_s)
  core.register_service("triscope_pick_stats", "http", function(applet)
    local age = table_age_s()
    local body, content_type
    if applet.path == "/metrics" then
      body, content_type = prometheus_text(age), "text/plain; version=0.0.4"
    else
      local parts = {}
      for _, key in ipairs(M.KEYS) do
        parts[#parts + 1] = string.format('"%s": %d', key, M.counts[key])
      end
      local age_text = age ~= nil and string.format("%.3f", age) or "null"
      body, content_type = "{" .. table.concat(parts, ", ") .. ', "table_age_s": ' .. age_text .. "}\n", "application/json"
    end
    applet:set_status(200)
    applet:add_header("content-type", content_type)
    applet:add_header("content-length", tostring(#body))
    applet:start_response()
    applet:send(body)
  end)
end

return M
