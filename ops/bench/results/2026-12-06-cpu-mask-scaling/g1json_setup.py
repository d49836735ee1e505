"""What every script beside this file starts from: the repository on sys.path, the benchmark model's tokenizer of
`size` tokens (ops/bench/harness.py), G1-JSON's output as its tokens (ops/bench/grammar_step.py's OUTPUT), the EOS
id and G1-JSON's grammar text (core/structured.py)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "ops" / "bench")]

from gen import SCHEMA_G1JSON  # noqa: E402
from grammar_step import OUTPUT  # noqa: E402

from core import structured  # noqa: E402
from ops.bench import harness  # noqa: E402
from worker import tinymodel  # noqa: E402


def g1json(size: int = 640):
    """(tokenizer, G1-JSON's output as token ids, [EOS id], G1-JSON's grammar)."""
    tok = harness.tokenizer(size)
    trace = tok(OUTPUT, add_special_tokens=False)["input_ids"]
    fmt = {"type": "json_schema", "json_schema": {"name": "g1json", "schema": SCHEMA_G1JSON, "strict": True}}
    return tok, trace, [tok.convert_tokens_to_ids(tinymodel.EOS)], structured.grammar({"response_format": fmt})
