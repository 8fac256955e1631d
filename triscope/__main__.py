from triscope.cli import entry

entry()
