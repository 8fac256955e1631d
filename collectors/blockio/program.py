"""The embedded bpftrace program and the marks it prints.

What the program measures and why it is built this way (per-window map sets, the control
probe, the ``@keys`` counts): docs/blockio.md, "What the bpftrace program measures".
"""

from __future__ import annotations

MAP_KEYS_MAX = 4096
"""Keys per bpftrace map (``BPFTRACE_MAP_KEYS_MAX``, set for the program): a full request-start
map takes no new requests, which then go uncounted."""
WINDOW_MARK = "triscope-window-end"
"""printf of the interval probe: ``triscope-window-end <nsecs>`` (kernel CLOCK_MONOTONIC), the
instant the probe chose which map sets to print and clear."""
WINDOW_START_MARK = "triscope-window-start"
"""printf of BEGIN (bpftrace may still be attaching probes: the window start only without the control probe)."""
WINDOW_FINAL_MARK = "triscope-window-final"
"""printf of END (bpftrace stopping): ``triscope-window-final <nsecs>``, after every map set."""
WINDOW_LIVE_MARK = "triscope-window-live"
"""printf of the control probe: counting starts (every probe attached)."""
WINDOW_STOP_MARK = "triscope-window-stop"
"""printf of the control probe: the instant counting stopped."""
MARKS = (WINDOW_MARK, WINDOW_START_MARK, WINDOW_LIVE_MARK, WINDOW_FINAL_MARK, WINDOW_STOP_MARK)
CONTROL_MAGIC_BASE = 2_000_000_000
"""``getpgid(magic)`` (no such pid: fails harmlessly) starts the counting, ``magic + 1`` stops it;
``magic`` = this + a random even offset per collector. BEGIN and END are no window bounds
(bpftrace attaches after BEGIN and detaches before END); these two instants are."""
BUFFERS = 6
"""Map sets the completion probe rotates through, one per window."""
AHEAD = 2
"""Map sets after the current one that an interval leaves alone: its print and clear run later,
in bpftrace's user space, by which time the next window may be counting into them."""

_PROGRAM_HEAD = r"""
BEGIN
{
  printf("triscope-window-start %llu\n", nsecs);
}

tracepoint:block:block_io_start  // acct
{  // acct
  if (@acct[args->dev, args->sector] == 0) { @keys[2] = count(); }  // acct
  @acct[args->dev, args->sector] = nsecs;  // acct
}  // acct

tracepoint:block:block_rq_merge  // acct
{  // acct
  if (@acct[args->dev, args->sector] > 0) { @keys[3] = count(); }  // acct
  delete(@acct[args->dev, args->sector]);  // acct
}  // acct

tracepoint:block:block_rq_issue
{
  if (@start[args->dev, args->sector] == 0) { @keys[0] = count(); }
  @start[args->dev, args->sector] = nsecs;
}

tracepoint:block:block_rq_complete
/@start[args->dev, args->sector] > 0__WHILE_LIVE__/
{
  $d = args->dev;
  $ma = $d >> 20;
  $mi = $d & 0xfffff;
  $n = nsecs;
  $s = @start[$d, args->sector];
  $lat = $n - $s;
  $q = $s;
  $a = @acct[$d, args->sector];  // acct
  if ($a > 0 && $a <= $s) { $q = $a; }  // acct
  if ($a > 0) { @keys[3] = count(); }  // acct
  delete(@acct[$d, args->sector]);  // acct
  delete(@start[$d, args->sector]);
  @keys[1] = count();
  $w = $n / __WINDOW_NS__;
  $b = $w % __BUFFERS__;
__STORES__
}

tracepoint:block:block_rq_requeue
{
  if (@start[args->dev, args->sector] > 0) { @keys[1] = count(); }
  delete(@start[args->dev, args->sector]);
}

interval:ms:__INTERVAL_MS__
{
  $now = nsecs;
  $cur = ($now / __WINDOW_NS__) % __BUFFERS__;
__FLUSHES__
  print(@keys);
  printf("triscope-window-end %llu\n", $now);
}

tracepoint:syscalls:sys_enter_getpgid  // ctl
/args->pid == __LIVE_MAGIC__ || args->pid == __STOP_MAGIC__/  // ctl
{  // ctl
  if (args->pid == __LIVE_MAGIC__) {  // ctl
    if (@state == 0) { @state = 1; printf("triscope-window-live %llu\n", nsecs); }  // ctl
  } else {  // ctl
    @state = 2;  // ctl
    printf("triscope-window-stop %llu\n", nsecs);  // ctl
  }  // ctl
}  // ctl

END
{
__FINAL__
  clear(@start);
  clear(@keys);
  clear(@acct);  // acct
  clear(@state);  // ctl
  printf("triscope-window-final %llu\n", nsecs);
}
"""

_STORE = ("  if ($b == {i}) {{ @usecs_{i}[$w, $ma, $mi, args->rwbs] = hist($lat / 1000);"
          " @lat_ns_{i}[$w, $ma, $mi, args->rwbs] = sum($lat); @qd_ns_{i}[$w, $ma, $mi] = sum($n - $q); }}")
_FLUSH = ("  if (({i} + __BUFFERS__ - $cur) % __BUFFERS__ > __AHEAD__) {{"
          " print(@usecs_{i}); print(@lat_ns_{i}); print(@qd_ns_{i});"
          " clear(@usecs_{i}); clear(@lat_ns_{i}); clear(@qd_ns_{i}); }}")
_FINAL = ("  print(@usecs_{i}); print(@lat_ns_{i}); print(@qd_ns_{i});"
          " clear(@usecs_{i}); clear(@lat_ns_{i}); clear(@qd_ns_{i});")


def bpftrace_program(interval_s: float, accounting: bool, buffers: int = BUFFERS, control_magic: int = 0) -> str:
    """The program for windows of ``interval_s`` (whole ms, at least 100); the IO-accounting
    probes (lines tagged ``// acct``) only with ``accounting``; the control probe (``// ctl``,
    see :data:`CONTROL_MAGIC_BASE`) and the live gate on completions only with a ``control_magic``."""
    ms = max(100, round(interval_s * 1000))
    text = (_PROGRAM_HEAD.replace("__STORES__", "\n".join(_STORE.format(i=i) for i in range(buffers)))
            .replace("__FLUSHES__", "\n".join(_FLUSH.format(i=i) for i in range(buffers)))
            .replace("__FINAL__", "\n".join(_FINAL.format(i=i) for i in range(buffers)))
            .replace("__WINDOW_NS__", str(ms * 1_000_000)).replace("__BUFFERS__", str(buffers))
            .replace("__AHEAD__", str(AHEAD))
            .replace("__INTERVAL_MS__", str(ms))
            .replace("__WHILE_LIVE__", " && @state == 1" if control_magic else "")
            .replace("__LIVE_MAGIC__", str(control_magic)).replace("__STOP_MAGIC__", str(control_magic + 1)))
    kept = [ln for ln in text.splitlines()
            if (accounting or "// acct" not in ln) and (control_magic or "// ctl" not in ln)]
    return "\n".join(ln.split("  // acct")[0].split("  // ctl")[0] for ln in kept) + "\n"
