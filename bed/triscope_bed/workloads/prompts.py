"""Request bodies for peers that route on the request text: a synthetic prompt per arrival and the
``POST /v1/completions`` JSON around it (OpenAI fields plus the simulator's token counts)."""

from __future__ import annotations

import json
from typing import Any

from triscope_bed.engines.engine import MODEL
from triscope_bed.workloads.arrivals import Arrival

MAX_PROMPT_CHARS = 48_000
"""Cap of the synthetic prompt text: the simulated backend refuses bodies over 64 KiB."""
_WORDS = ("the", "a", "of", "and", "to", "in", "is", "for", "on", "with", "data", "model", "code", "value",
          "return", "list", "time", "user", "file", "error", "test", "input", "output", "index", "result",
          "string", "number", "class", "function", "request", "server", "memory", "batch", "token", "query")


CHARS_PER_TOKEN = 4.0
"""Characters of synthetic prompt per requested prompt token (the tiny vLLM model's tokenizer reads
about 4.8 of these characters per token, so a real engine sees about 0.83 x ``prompt_tokens``)."""
MAX_SALT_CHARS = 64


def synthetic_prompt(idx: int, cls: str, prompt_tokens: int, salt: str = "",
                     chars_per_token: float = CHARS_PER_TOKEN) -> str:
    """Deterministic text of about ``prompt_tokens x chars_per_token`` characters (at most :data:`MAX_PROMPT_CHARS`).

    It opens with ``salt`` and the arrival's index, so no two requests share a prefix (the replayed
    trace has no text, hence no prefix sharing to model); a salt per run (say policy and seed) also
    keeps an engine's prefix cache from serving a later run the prompts of an earlier one. The rest
    is a slice, placed by ``idx``, of a fixed run of common English words (a slice, not a loop per
    request, so a 30 kB prompt costs microseconds).
    """
    if not 0.5 <= chars_per_token <= 64 or len(salt) > MAX_SALT_CHARS:
        raise ValueError(f"chars_per_token in [0.5, 64] and a salt of <= {MAX_SALT_CHARS} characters expected")
    want = min(MAX_PROMPT_CHARS, max(8, round(prompt_tokens * chars_per_token)))
    head = f"{salt} request {idx} {cls}: " if salt else f"request {idx} {cls}: "
    words = _word_pool()
    start = (idx * 7919) % (len(words) - MAX_PROMPT_CHARS)
    return (head + words[start:start + want])[:want]


def block_text(block_id: int, chars: int) -> str:
    """The text of prompt block ``block_id``: the same ``chars`` characters wherever the id appears, another
    id's text from its first characters on (a block of a trace with prefix structure)."""
    words = _word_pool()
    start = (block_id * 104_729) % (len(words) - MAX_PROMPT_CHARS)
    head = f"<{block_id}> "
    return (head + words[start:start + max(0, chars - len(head))])[:chars]


def blocks_prompt(blocks: tuple[int, ...], block_chars: int, total_chars: int, salt: str = "") -> str:
    """The blocks' texts in order (after ``salt``), cut to ``total_chars`` and :data:`MAX_PROMPT_CHARS`: two
    prompts whose block ids agree up to block k agree up to block k's last character."""
    want = min(MAX_PROMPT_CHARS, max(8, total_chars))
    parts, n = [salt + " "] if salt else [], len(salt) + 1 if salt else 0
    for b in blocks:
        if n >= want:
            break
        parts.append(block_text(b, block_chars))
        n += block_chars
    return "".join(parts)[:want]


_POOL: list[str] = []


def _word_pool() -> str:
    """2 x :data:`MAX_PROMPT_CHARS` of words in a fixed pseudo-random order (an LCG: the same in every process)."""
    if not _POOL:
        parts, n, x = [], 0, 12345
        while n < 2 * MAX_PROMPT_CHARS:
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF
            word = _WORDS[(x >> 16) % len(_WORDS)]
            parts.append(word)
            n += len(word) + 1
        _POOL.append(" ".join(parts))
    return _POOL[0]


MAX_EXTRA_BODY_BYTES = 4096


def completion_body(a: Arrival, idx: int, model: str = MODEL, *, salt: str = "",
                    chars_per_token: float = CHARS_PER_TOKEN, extra: dict[str, Any] | None = None) -> bytes:
    """The ``POST /v1/completions`` JSON of one arrival (OpenAI fields plus the simulator's token counts).

    ``extra``: more fields for a real engine (``{"ignore_eos": True, "min_tokens": ...}`` makes vLLM
    generate exactly ``max_tokens``); it may not replace the fields above and is at most 4 KiB.
    """
    prompt, out = a.tokens()
    if a.blocks:
        text = blocks_prompt(a.blocks, max(1, round(a.block_tokens * chars_per_token)),
                             round(prompt * chars_per_token), salt)
    else:
        text = synthetic_prompt(idx, a.cls, prompt, salt, chars_per_token)
    doc: dict[str, Any] = {"model": model, "prompt": text, "prompt_tokens": prompt, "max_tokens": out,
                           "request_class": a.cls}
    if a.blocks:  # the simulator's prefix cache reads them; an engine ignores them
        doc["prefix_blocks"], doc["block_tokens"] = list(a.blocks), a.block_tokens
    if extra:
        clash = doc.keys() & extra.keys()
        if clash or len(json.dumps(extra)) > MAX_EXTRA_BODY_BYTES:
            raise ValueError(f"extra body fields: {', '.join(sorted(clash)) or 'over 4 KiB'}")
        doc.update(extra)
    return json.dumps(doc).encode()
