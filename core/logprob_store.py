"""Log-probabilities as a row stores them (`results.logprobs`), and OpenAI's shape, built when they are read.

What a reader gets (api/results.py, core/openai_batch.py) is OpenAI's chat `choices[].logprobs.content`: per
generated token {"token": text, "logprob": float, "bytes": [UTF-8 bytes], "top_logprobs": [{"token", "logprob",
"bytes"}, … most likely first]} (worker/engines/logprobs.py says which distribution and which text).

What the row stores is one compact object per output (format 1):

    {"format": 1, "n": tokens, "k": top_logprobs,
     "ids": int32[n], "logprob": float32[n],            # the chosen tokens and their log-probabilities
     "top_ids": int32[n*k], "top_logprob": float32[n*k], # each step's k most likely, row-major
     "vocab": int32[m], "text": [m strings], "bytes": [m hex strings]}   # the text of each token used, once

where each array is base64 of its little-endian bytes. Why not OpenAI's shape itself: G1 with top-5 logprobs is
1,024 rows × 256 tokens × 6 entries, 1.5 million dicts; building them on the worker cost more host time than the
whole generation (0.36 × the throughput without logprobs on the H200, most of it the garbage collector walking
them). The compact form costs the worker a few array copies per row, and the dicts are built only when someone
reads the rows; it is about half the size (G1's shape with random tokens: 77 MB against 165 MB of JSON per job, most
of it the text of the ~1,500 distinct tokens each row uses). The texts are stored, not looked up when read: the API
has no tokenizer (a model may only be on the worker's host).

Rows stored before format 1 hold OpenAI's shape itself (a list of entries, a list of them per output with several
outputs): `render` and `render_row` return those as they are.
"""

from __future__ import annotations

import base64
import sys
from array import array
from typing import Any

FORMAT = 1
# JSON has no -inf: a token the model gave no probability at all (a masked EOS) is reported as -9999.0, as OpenAI's
# API reports one
NO_PROBABILITY = -9999.0


def render(value: Any) -> list[dict[str, Any]] | None:
    """One output's entries in OpenAI's shape, from what the row stored for it (None where none was asked)."""
    if not isinstance(value, dict):
        return value  # None, or stored in OpenAI's shape already (before format 1)
    if value.get("format") != FORMAT:
        raise ValueError(f"stored log-probabilities in an unknown format {value.get('format')!r}")
    k = value["k"]
    ids, picked = _array("i", value["ids"]), _array("f", value["logprob"])
    top_ids, top_values = _array("i", value["top_ids"]), _array("f", value["top_logprob"])
    names = {
        token: (text, list(bytes.fromhex(raw)))
        for token, text, raw in zip(_array("i", value["vocab"]), value["text"], value["bytes"])
    }
    out = []
    for i, token in enumerate(ids):
        text, raw = names[token]
        top = [
            {"token": names[alt][0], "logprob": _clamp(lp), "bytes": names[alt][1]}
            for alt, lp in zip(top_ids[i * k : (i + 1) * k], top_values[i * k : (i + 1) * k])
        ]
        out.append({"token": text, "logprob": _clamp(picked[i]), "bytes": raw, "top_logprobs": top})
    return out


def render_row(value: Any) -> Any:
    """A row's stored log-probabilities in OpenAI's shape: one output's entries, or a list of them per output."""
    if isinstance(value, dict):
        return render(value)
    if isinstance(value, list) and value and (isinstance(value[0], list) or "format" in (value[0] or {})):
        return [render(v) for v in value]  # several outputs
    return value  # None, or one output stored in OpenAI's shape already


def _clamp(value: float) -> float:
    return value if value > NO_PROBABILITY else NO_PROBABILITY


def _array(code: str, text: str) -> list:
    values = array(code)
    values.frombytes(base64.b64decode(text))
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()
