"""Worker for the real 2-process gloo tests (run as a script; not collected by pytest).

usage: python nccl_gloo_worker.py OUT_DIR PORT RANK WORLD DELAY_RANK DELAY_S ITERS

Every rank runs ITERS steps of (optional compute, sleep on DELAY_RANK, all_reduce, all_gather)
under torch.profiler, then writes its Kineto trace (``rank<N>.json``) and its Flight Recorder
dump (pickle ``fr_rank<N>`` and ``fr_rank<N>.json``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    out, port, rank, world, delay_rank, delay_s, iters = sys.argv[1:8]
    rank, world, delay_rank, iters = int(rank), int(world), int(delay_rank), int(iters)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.ones(256, 1024)
    small = torch.ones(64)
    gathered = [torch.empty(64) for _ in range(world)]
    dist.barrier()
    Path(out).mkdir(parents=True, exist_ok=True)
    schedule = torch.profiler.schedule(wait=0, warmup=0, active=iters, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                schedule=schedule) as prof:
        dist.barrier()  # both profilers are running: start the steps together
        for _ in range(iters):
            with torch.profiler.record_function("step"):
                if rank == delay_rank:
                    time.sleep(float(delay_s))
                dist.all_reduce(x)
                dist.all_gather(gathered, small)
            prof.step()
    dist.barrier()
    prof.export_chrome_trace(str(Path(out) / f"rank{rank}.json"))
    # gloo leaves every Flight Recorder entry "scheduled" and marks it retired from its work thread,
    # possibly after wait() returned: under load a dump taken at once can still show the last
    # barrier as pending (seen in CI). Wait until every entry is retired (or completed).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        entries = json.loads(_dump_fr_trace_json()).get("entries", [])
        if all(e.get("retired") or e.get("state") == "completed" for e in entries):
            break
        time.sleep(0.05)
    (Path(out) / f"fr_rank{rank}").write_bytes(_dump_fr_trace())
    (Path(out) / f"fr_rank{rank}.json").write_bytes(_dump_fr_trace_json())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
