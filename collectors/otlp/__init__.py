"""OTLP/HTTP trace receiver (``[run] collectors = ["otlp"]``): wire decoding in :mod:`.wire` (protobuf),
:mod:`.json_spans` and :mod:`.decode`, span linking in :mod:`.links`, the server and collector in
:mod:`.receiver`. Spans are spooled through the writer before the answer."""

from triscope.collectors.otlp.decode import decode_spans, encode_response, encode_status
from triscope.collectors.otlp.links import SpanMapper
from triscope.collectors.otlp.receiver import TRACES_PATH, OtlpConfig, OtlpReceiver, create

__all__ = ["TRACES_PATH", "OtlpConfig", "OtlpReceiver", "SpanMapper", "create", "decode_spans", "encode_response",
           "encode_status"]
