"""Collective-communication data (NCCL, RCCL, gloo) into ``nccl_ops``.

Parsers per source (:mod:`.inspector`, :mod:`.flight_recorder`, :mod:`.tests_output` for nccl-tests
stdout, :mod:`.kineto` for traces already in the store), shared row building in :mod:`.common`, and
:mod:`.ingest`, which detects a file's format and stores its rows through the file-ingest path
(:mod:`triscope.collectors.ingest_sink`).
"""
