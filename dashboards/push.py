"""Upload the boards to a running Grafana with ``grafana-client`` (HTTP API).

The folder is looked up by uid (``GET /api/folders/{uid}``) and created when missing
(``POST /api/folders``); each board is saved with ``POST /api/dashboards/db`` and
``overwrite: true`` into that folder. Credentials come from the environment only: a service-account
token, or ``user:password`` for basic auth.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from triscope.dashboards.boards import all_boards
from triscope.dashboards.model import FOLDER_TITLE, FOLDER_UID
from triscope.errors import ConfigError, TriscopeError

TOKEN_ENV = "GRAFANA_TOKEN"
BASIC_ENV = "GRAFANA_BASIC_AUTH"


class PushError(TriscopeError):
    """Grafana refused or could not be reached."""


@dataclass(frozen=True)
class Pushed:
    """One saved board as Grafana answered."""

    uid: str
    title: str
    url: str
    version: int
    status: str


def credential_from_env(token_env: str = TOKEN_ENV, basic_env: str = BASIC_ENV,
                        environ: Mapping[str, str] | None = None) -> str | tuple[str, str]:
    """A token (``$token_env``) or a ``(user, password)`` pair (``$basic_env`` = ``user:password``)."""
    env = os.environ if environ is None else environ
    token = env.get(token_env, "").strip()
    if token:
        return token
    basic = env.get(basic_env, "")
    if basic:
        user, sep, password = basic.partition(":")
        if not sep or not user:
            raise ConfigError(f"${basic_env} must be user:password")
        return (user, password)
    raise ConfigError(f"no Grafana credentials: set ${token_env} (service-account token) or ${basic_env} "
                      "(user:password)")


def _check_url(url: str) -> None:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"--url must be http(s)://host[:port][/path], got {url!r}")
    if parsed.username or parsed.password:
        raise ConfigError("--url must not carry credentials; use $GRAFANA_TOKEN or $GRAFANA_BASIC_AUTH")


def ensure_folder(api: Any, title: str, uid: str) -> str:
    """The folder's uid, creating the folder when Grafana has none with that uid."""
    from grafana_client.client import GrafanaClientError

    try:
        found = api.folder.get_folder(uid)
        return str(found.get("uid", uid))
    except GrafanaClientError as exc:
        if exc.status_code != 404:
            raise
    created = api.folder.create_folder(title, uid=uid)
    return str(created.get("uid", uid))


def push(url: str, credential: str | tuple[str, str], folder_title: str = FOLDER_TITLE,
         folder_uid: str = FOLDER_UID, boards: Mapping[str, dict[str, Any]] | None = None,
         timeout: float = 10.0, message: str = "triscope dashboards push") -> list[Pushed]:
    """Create the folder if needed and save every board into it (overwriting older versions)."""
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaException

    _check_url(url)
    api = GrafanaApi.from_url(url, credential=credential, timeout=timeout)
    out = []
    try:
        folder = ensure_folder(api, folder_title, folder_uid)
        for board in (all_boards() if boards is None else boards).values():
            body = copy.deepcopy(board)
            body["id"] = None  # matched by uid; Grafana assigns ids
            answer = api.dashboard.update_dashboard({"dashboard": body, "folderUid": folder, "overwrite": True,
                                                     "message": message})
            out.append(Pushed(str(answer.get("uid", body["uid"])), body["title"], str(answer.get("url", "")),
                              int(answer.get("version", 0) or 0), str(answer.get("status", ""))))
    except GrafanaException as exc:
        raise PushError(f"Grafana at {url}: {exc.message or exc}".splitlines()[0]) from None
    except OSError as exc:  # the HTTP client's connection errors (refused, DNS, TLS) are OSErrors
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PushError(f"Grafana at {url} is unreachable: {reason}") from None
    return out
