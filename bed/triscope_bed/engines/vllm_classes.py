"""The request classes of the vLLM-CPU test bed and their token sizes (the routing classes of docs/weights.md).

An image or a video frame is emulated as extra prompt tokens (:mod:`triscope_bed.workloads.vllm_load`
sends them; docs/vllm-testbed.md has the sizes). Data only, so the calibrated simulator
(:mod:`triscope_bed.engines.calibration`) reads the sizes without the vLLM client.
"""

from __future__ import annotations

from dataclasses import dataclass

TOKEN_ID_RANGE = (16, 4000)
"""Prompt token ids are drawn from here: clear of the tiny tokenizer's special tokens (0-5), inside its 4096."""


@dataclass(frozen=True)
class RequestClass:
    """Token sizes of one kind of request (prompt = text + media tokens)."""

    name: str
    kind: str
    text_tokens: int
    media_tokens: int
    output_tokens: int
    media: str = ""

    @property
    def prompt_tokens(self) -> int:
        return self.text_tokens + self.media_tokens


CLASSES: dict[str, RequestClass] = {c.name: c for c in (
    # a spoken turn: its transcript with some context in, a short spoken answer out
    RequestClass("realtime_speech", "speech", text_tokens=48, media_tokens=0, output_tokens=16),
    # a question about one 336x336 image: 12 x 12 patches of 28 px = 144 image tokens
    RequestClass("interactive_image_text", "image-text", text_tokens=32, media_tokens=144, output_tokens=96,
                 media="1 image 336x336 = 144 tokens"),
    # a summary of a clip: 4 frames of 224x224, 8 x 8 patches each = 256 tokens
    RequestClass("offline_video", "video", text_tokens=16, media_tokens=256, output_tokens=128,
                 media="4 frames 224x224 = 4 x 64 tokens"),
)}
"""Every class fits ``--max-model-len 512`` (the largest, video, is 272 + 128 = 400 tokens). Image-text and
video cross a 128-token KV block boundary while decoding (176 -> 272, 272 -> 400), so a full cache preempts."""
