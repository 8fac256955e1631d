"""Configuration mistakes are one line and exit 2, before anything is opened or bound.

Each case is a mistake a user made: wrong types, out-of-range values, unknown keys,
unreadable files, a factory that is not a component. ``triscope run`` must refuse all of them
at start with a one-line message naming the key, never a traceback and never silently.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from triscope.cli import main
from triscope.config import load_config
from triscope.daemon import Daemon
from triscope.errors import ConfigError

BASE = '[run]\ncollectors = ["blockio_diskstats"]\n[store]\npath = "{store}"\n[writer]\nspool_dir = "{spool}"\n'

MISTAKES = {
    "[run] interval as text": ('[blockio]\ninterval_s = "fast"\n', "interval_s"),
    "[run] absurd interval": ("[blockio]\ninterval_s = 1e99\n", "interval_s"),
    "[writer] negative spool cap": ("[writer]\nspool_max_bytes = -1\n", "spool_max_bytes"),
    "[store] database with a space": ('[store]\ndatabase = "a b"\n', "database"),
    "[store] empty path": ('[store]\npath = ""\n', "path"),
    "[writer] unknown key": ("[writer]\nbatch_rowz = 5\n", "batch_rowz"),
    "[run] unknown key": ("[run]\nstatus_intervl_s = 5\n", "status_intervl_s"),
    "[run] a factory that is not a component": ('[run]\ncollectors = ["os:system"]\n', "os:system"),
    "[run] an unknown collector": ('[run]\ncollectors = ["nope"]\n', "nope"),
    "[blockio] unknown key": ("[blockio]\nformatt = 'json'\n", "formatt"),
    "[weights] negative lookback": ('[run]\nexporters = ["weights_feed"]\n[weights]\nlookback_s = -5\n', "lookback_s"),
    "[otlp] port out of range": ('[run]\ncollectors = ["otlp"]\n[otlp]\nport = 99999\n', "port"),
    "[otlp] misspelt token": ('[run]\ncollectors = ["otlp"]\n[otlp]\ntokn = "secret"\n', "tokn"),
    "[query] misspelt key": ("[query]\npasword = 'x'\n", "pasword"),
    "[query] port out of range": ("[query]\nport = 70000\n", "port"),
}


def _config_text(tmp_path: Path, extra: str) -> str:
    base = BASE.format(store=tmp_path / "store", spool=tmp_path / "spool")
    # a later [section] header would repeat a table: merge by letting TOML dotted keys override
    sections: dict[str, list[str]] = {}
    current = ""
    for line in (base + extra).splitlines():
        if line.startswith("["):
            current = line
            sections.setdefault(current, [])
        elif line.strip():
            key = line.split("=")[0].strip()
            sections[current] = [x for x in sections[current] if x.split("=")[0].strip() != key] + [line]
    return "\n".join(f"{head}\n" + "\n".join(lines) for head, lines in sections.items()) + "\n"


@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_run_refuses_a_config_mistake_with_one_line(case: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    extra, key = MISTAKES[case]
    path = tmp_path / "triscope.toml"
    path.write_text(_config_text(tmp_path, extra))
    with pytest.raises(ConfigError) as err:
        Daemon(load_config(path, environ={})).start()
    message = str(err.value)
    assert key in message and "\n" not in message
    assert not (tmp_path / "store").exists() and not (tmp_path / "spool").exists()  # nothing opened


def test_unreadable_config_files_are_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"[store]\npath = \"\xff\xfe\"\n")
    cases = {str(tmp_path): "is a directory", str(binary): "not UTF-8",
             str(tmp_path / "missing.toml"): "not found"}
    for config, words in cases.items():
        code = main(["run", "--config", config])
        err = capsys.readouterr().err
        assert code == 2 and words in err and err.count("\n") == 1, (config, err)


def test_env_override_below_a_scalar_is_one_line(tmp_path: Path) -> None:
    config = load_config(None, environ={"TRISCOPE_STORE__PATH__X": "1",
                                        "TRISCOPE_RUN__COLLECTORS": '["blockio_diskstats"]'})
    with pytest.raises(ConfigError, match=r"\[store\] has a bad value for path: must be a string"):
        Daemon(config)


def test_a_store_path_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    from triscope.store.embedded import EmbeddedStore

    file = tmp_path / "not-a-dir"
    file.write_text("x")
    with pytest.raises(ConfigError, match="cannot be a data directory"):
        EmbeddedStore(str(file / "data"))


@pytest.mark.parametrize(("section", "hint"), [("otpl", "[otlp]"), ("OTLP", "[otlp]"), ("wieghts", "[weights]"),
                                               ("grafana", "")])
def test_an_unknown_section_is_one_line_exit_2_with_a_suggestion(section: str, hint: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "triscope.toml"
    path.write_text(_config_text(tmp_path, f'[{section}]\ntoken = "secret"\n'))
    assert main(["run", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"unknown section [{section}]" in err and err.count("\n") == 1 and "known: analysis, " in err
    assert (f"did you mean {hint}?" in err) if hint else ("did you mean" not in err)
    assert not (tmp_path / "store").exists()
    with pytest.raises(ConfigError, match=r"TRISCOPE_\* environment has an unknown section \[otpl\]"):
        load_config(None, environ={"TRISCOPE_OTPL__TOKEN": "x"})


def test_every_component_section_is_a_known_section() -> None:
    import importlib

    from triscope.component import ComponentConfig
    from triscope.config import SECTIONS
    from triscope.registry import COLLECTORS, EXPORTERS

    for target in {*COLLECTORS.values(), *EXPORTERS.values()}:
        importlib.import_module(target.partition(":")[0])
    importlib.import_module("triscope.analyzers.heatmap")
    importlib.import_module("triscope.analyzers.stalls")
    seen, todo = set(), list(ComponentConfig.__subclasses__())
    while todo:
        cls = todo.pop()
        seen.add(cls)
        todo += [c for c in cls.__subclasses__() if c not in seen]
    sections = {c.section.split(".")[0] for c in seen if getattr(c, "section", "")}
    assert sections and sections <= set(SECTIONS), sections - set(SECTIONS)


def test_a_custom_component_keeps_its_own_section(tmp_path: Path) -> None:
    path = tmp_path / "triscope.toml"
    path.write_text('[run]\ncollectors = ["mypkg.collector:create"]\n[mypkg]\nrate = 5\n')
    assert load_config(path, environ={})["mypkg"] == {"rate": 5}
