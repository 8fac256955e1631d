"""Template variables and SQL filter fragments shared by the boards.

Every query variable reads its values from the store for the dashboard's time range. Filters
use the plugin's ``$__conditionalAll(cond, $var)``: with *All* selected the condition becomes
``1=1`` (no giant ``IN`` list), otherwise ``col IN (${var:singlequote})``.
"""

from __future__ import annotations

from triscope.dashboards.model import Variable
from triscope.schema import GPU_SAMPLES, REQUESTS, SERVING_METRICS, Table

DATABASE = Variable("database", "ClickHouse database", kind="textbox", default="triscope", hide=2,
                    description="database holding the triscope tables ([store] database)")


def t(table: Table) -> str:
    """A table of the triscope database, as the boards write it."""
    return f"${{database}}.{table.name}"


def cond(column: str, var: str) -> str:
    """``$__conditionalAll(column IN (${var:singlequote}), $var)``."""
    return f"$__conditionalAll({column} IN (${{{var}:singlequote}}), ${var})"


def conds(pairs: list[tuple[str, str]]) -> str:
    """Several :func:`cond` joined with AND (``1=1`` when empty)."""
    return " AND ".join(cond(c, v) for c, v in pairs) or "1=1"


def distinct(column: str, tables: list[Table], where: list[tuple[str, str]], ts: str = "ts",
              order: str = "") -> str:
    parts = []
    for table in tables:
        filters = "".join(f" AND {cond(c, v)}" for c, v in where)
        parts.append(f"SELECT toString({column}) AS v FROM {t(table)} WHERE $__timeFilter({ts}) "
                     f"AND toString({column}) != ''{filters}")
    return f"SELECT DISTINCT v FROM ({' UNION ALL '.join(parts)}) ORDER BY {order or 'v'}"


def host_var(*tables: Table) -> Variable:
    """Hosts seen in ``tables`` in the time range."""
    return Variable("host", "Host", distinct("host", list(tables), []))


def gpu_var() -> Variable:
    """GPU indices of the selected hosts (gpu_samples)."""
    return Variable("gpu", "GPU", distinct("gpu", [GPU_SAMPLES], [("host", "host")],
                                            order="toUInt32OrZero(v), v"))


def backend_var() -> Variable:
    """Serving backends of the selected hosts (requests, serving_metrics)."""
    return Variable("backend", "Backend", distinct("backend", [REQUESTS, SERVING_METRICS],
                                                    [("host", "host")]))


def request_var(column: str, label: str) -> Variable:
    """Values of one ``requests`` column for the selected hosts and backends."""
    return Variable(column, label, distinct(column, [REQUESTS], [("host", "host"), ("backend", "backend")]))


def request_vars() -> list[Variable]:
    """model, model_version, modality, input_resolution, request_class."""
    return [request_var("model", "Model"), request_var("model_version", "Model version"),
            request_var("modality", "Modality"), request_var("input_resolution", "Input resolution"),
            request_var("request_class", "Request class")]


REQUEST_DIMENSIONS = ["model", "model_version", "modality", "input_resolution", "request_class"]
# requests.gpu holds an index or a uuid: a selected index also matches its GPU's uuid
REQUEST_GPU = ("$__conditionalAll((gpu IN (${gpu:singlequote}) OR gpu IN (SELECT gpu_uuid FROM "
               f"{t(GPU_SAMPLES)} WHERE toString(gpu) IN (${{gpu:singlequote}}) AND "
               "$__conditionalAll(host IN (${host:singlequote}), $host) AND $__timeFilter(ts))), $gpu)")
REQUEST_FILTER = " AND ".join([conds([("host", "host"), ("backend", "backend")]
                                     + [(c, c) for c in REQUEST_DIMENSIONS]), REQUEST_GPU])
REQUEST_SELECTED = conds([(c, c) for c in REQUEST_DIMENSIONS])
BACKEND_FILTER = conds([("host", "host"), ("backend", "backend")])
GPU_FILTER = conds([("host", "host"), ("toString(gpu)", "gpu")])

