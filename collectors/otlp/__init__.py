"""OTLP/HTTP trace receiver (``[run] collectors = ["otlp"]``): wire decoding in :mod:`.decode`, the
server and collector in :mod:`.receiver`. Spans are spooled through the writer before the answer."""

from triscope.collectors.otlp.decode import decode_request, encode_response, encode_status, map_request
from triscope.collectors.otlp.receiver import TRACES_PATH, OtlpConfig, OtlpReceiver, create

__all__ = ["TRACES_PATH", "OtlpConfig", "OtlpReceiver", "create", "decode_request", "encode_response",
           "encode_status", "map_request"]
