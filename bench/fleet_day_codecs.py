"""Candidate codecs per column, measured on a copy of the rows (bench/fleet_day.py --try-codecs).

For each table a scratch MergeTree with the same sort key holds every column once per candidate
codec (``col__0``, ``col__1``, ...), filled by one INSERT ... SELECT and merged; the smallest
candidate per column wins, a cheaper one (listed earlier) when within 3 % of it.
"""

from __future__ import annotations

from typing import Any

from triscope.schema import Table, qualified
from triscope.store.base import Store

TIME = ["LZ4", "ZSTD(1)", "Delta, ZSTD(1)", "DoubleDelta", "DoubleDelta, LZ4", "DoubleDelta, ZSTD(1)",
        "DoubleDelta, ZSTD(3)"]
FLOAT = ["LZ4", "ZSTD(1)", "ZSTD(3)", "Gorilla", "Gorilla, LZ4", "Gorilla, ZSTD(1)", "FPC", "FPC, ZSTD(1)"]
INT = ["LZ4", "ZSTD(1)", "T64", "T64, LZ4", "T64, ZSTD(1)", "Delta, ZSTD(1)", "DoubleDelta, ZSTD(1)"]
TEXT = ["LZ4", "ZSTD(1)", "ZSTD(3)"]


def candidates(ch_type: str) -> list[str]:
    if ch_type.startswith("DateTime"):
        return TIME
    if ch_type.startswith("Float"):
        return FLOAT
    if ch_type.startswith(("UInt", "Int")):
        return INT
    return TEXT


def trial(store: Store, tables: tuple[Table, ...]) -> dict[str, dict[str, Any]]:
    """``{table: {column: {"best": codec, "bytes_per_value": {codec: B/value}}}}``; printed as it goes."""
    out: dict[str, dict[str, Any]] = {}
    for table in tables:
        scratch = f"{qualified(store, table)}_codec_trial"
        cols, select = [], []
        for c in table.columns:
            cols.append(f"`{c.name}` {c.type}")
            select.append(f"`{c.name}`")
            for i, codec in enumerate(candidates(c.type)):
                cols.append(f"`{c.name}__{i}` {c.type} CODEC({codec})")
                select.append(f"`{c.name}` AS `{c.name}__{i}`")
        store.command(f"DROP TABLE IF EXISTS {scratch}")
        store.command(f"CREATE TABLE {scratch} ({', '.join(cols)}) ENGINE = MergeTree ORDER BY ({table.order_by}) "
                      "SETTINGS min_bytes_for_wide_part = 0")
        store.command(f"INSERT INTO {scratch} SELECT {', '.join(select)} FROM {qualified(store, table)}")
        store.command(f"OPTIMIZE TABLE {scratch} FINAL")
        rows = int(store.query(f"SELECT count() FROM {scratch}").scalar() or 1)
        found = dict(store.query(
            "SELECT column, sum(column_data_compressed_bytes) FROM system.parts_columns WHERE database = {db:String} "
            "AND table = {t:String} AND active GROUP BY column",
            {"db": store.database, "t": f"{table.name}_codec_trial"}).rows)
        store.command(f"DROP TABLE {scratch}")
        per: dict[str, Any] = {}
        print(f"\ncodec trial {table.name} ({rows:,} rows): B/value per candidate")
        for c in table.columns:
            sizes = {codec: int(found[f"{c.name}__{i}"]) / rows for i, codec in enumerate(candidates(c.type))}
            smallest = min(sizes.values())
            best = next(codec for codec, size in sizes.items() if size <= smallest * 1.03 + 1e-4)
            per[c.name] = {"best": best, "bytes_per_value": sizes}
            shown = "  ".join(f"{k}={v:.3f}" for k, v in sizes.items())
            print(f"  {c.name:28s} best {best:22s} {shown}", flush=True)
        out[table.name] = per
    return out
