"""A submit's pre-flight over its parsed rows, before any GPU time: the token check and what the results need.

`TokenCheck` runs in the `validating` step where the model's tokenizer is readable in the API process:
`tokenizer.json` through the `tokenizers` library and the chat template through jinja2, never transformers (whose
AutoTokenizer imports torch). A row whose prompt plus `max_new_tokens` exceeds the model's context becomes a failed
row with the same reason the worker would give (`core.dataset.too_long`), before any GPU time.

`InputCheck` wraps the rows `core.dataset` parsed: it runs the token check on the good ones, 1,000 at a time, and
notes what the job's results need to know about its input (its format, its pass-through keys, whether a row has
several outputs or log-probabilities). `core.jobs.submit` runs it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from core import formats
from core.dataset import ParsedRow, too_long
from core.spec import sampling_of

TEMPLATE_SLACK = 32  # tokens a post-processor may add beyond one token per byte of text


class TokenCheck:
    """Prompt length against the model's context, in the API process, without torch or transformers.

    Built from a saved model directory: `tokenizer.json` (the `tokenizers` library), the chat template
    (`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`, rendered with jinja2 as transformers
    renders it) and the context length (`max_position_embeddings` in `config.json`). A row surely fits when its
    text's UTF-8 bytes + TEMPLATE_SLACK + max_new_tokens fit (no tokenizer makes more tokens than bytes plus the
    special tokens it adds), so only long rows are tokenized. A messages row whose template cannot be rendered
    here is checked by the sum of its contents' tokens, a lower bound: the worker checks it exactly.
    """

    def __init__(self, tokenizer: Any, context: int, template: Any, special: dict[str, Any]):
        self.tokenizer, self.context, self.template, self.special = tokenizer, context, template, special

    @classmethod
    def for_model(cls, model_dir: str | Path) -> TokenCheck | None:
        """The check for a local model directory, or None where the tokenizer or the context is not readable."""
        root = Path(model_dir)
        try:
            config = json.loads((root / "config.json").read_text())
            context = config.get("max_position_embeddings") or (config.get("text_config") or {}).get(
                "max_position_embeddings"
            )
            if not (root / "tokenizer.json").is_file() or not isinstance(context, int) or context <= 0:
                return None
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
            tok_config = _json_file(root / "tokenizer_config.json")
        except Exception:  # unreadable files, or a tokenizer.json this tokenizers version cannot load
            return None
        source = _read_text(root / "chat_template.jinja") or tok_config.get("chat_template")
        special = {k: _token_text(tok_config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls(tokenizer, context, _compile_template(source), special)

    def problems(self, inputs: list[dict[str, Any]], spec: Any) -> list[str | None]:
        """For each stored row input: None if it fits, else the reason (the worker's wording)."""
        out: list[str | None] = [None] * len(inputs)
        todo: dict[bool, list[tuple[int, str, int]]] = {True: [], False: []}  # by "with special tokens"
        for i, row in enumerate(inputs):
            new_tokens = sampling_of(spec, row.get("params"))["max_new_tokens"]
            text = self._text(row)
            if text is None:
                continue
            if len(text.encode("utf-8", "replace")) + TEMPLATE_SLACK + new_tokens <= self.context:
                continue  # surely fits: no tokenization needed
            todo["prompt" in row].append((i, text, new_tokens))
        for special, items in todo.items():
            if not items:
                continue
            # as the worker does: a prompt with the tokenizer's special tokens, a rendered chat template without
            encodings = self.tokenizer.encode_batch([t for _, t, _ in items], add_special_tokens=special)
            for (i, _, new_tokens), enc in zip(items, encodings):
                self._judge(out, i, len(enc.ids), new_tokens)
        return out

    def _judge(self, out: list[str | None], i: int, count: int, new_tokens: int) -> None:
        if count + new_tokens > self.context:
            out[i] = too_long(count, new_tokens, self.context)

    def _text(self, row: dict[str, Any]) -> str | None:
        """The text the worker tokenizes; for messages without a usable template, their contents (a lower bound)."""
        if "prompt" in row:
            return row["prompt"]
        messages = row.get("messages")
        if not messages:
            return None
        if self.template is not None:
            try:
                return self.template.render(messages=messages, add_generation_prompt=True, **self.special)
            except Exception:  # a template that needs what we do not provide: fall back to the lower bound
                pass
        return "".join(m.get("content") or "" for m in messages)


def _json_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _token_text(value: Any) -> Any:
    return value.get("content") if isinstance(value, dict) else value


def _compile_template(source: Any) -> Any:
    """A chat template compiled the way transformers compiles it (sandboxed jinja2), or None."""
    if not isinstance(source, str) or not source:
        return None
    try:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: __import__("datetime").datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except Exception:
        return None


EXTRA_KEYS_KEPT = 1000  # pass-through keys listed for CSV and Parquet results (JSONL results keep every key)


class InputCheck:
    """Wraps the parsed rows of a submit: runs the token check on good rows, 1,000 at a time, and notes what
    the job's results need to know about its input (its format and its pass-through keys, for table outputs)."""

    def __init__(self, spec: Any, chunk: int = 1000, *, model_dir: Path | None = None):
        """`model_dir`: where the model's config.json and tokenizer are (a Hub model's snapshot in this host's
        cache); default: the spec's model, when it is a local directory."""
        self.spec, self.chunk = spec, chunk
        self.where = formats.location(spec.input_format)
        model_dir = model_dir or Path(spec.model)
        self.tokens = TokenCheck.for_model(model_dir) if model_dir.is_absolute() and model_dir.is_dir() else None
        self.extra_keys: dict[str, None] = {}
        self.kinds: set[str] = set()  # prompt and/or messages: the columns `results --with-input` gives tables
        self.too_long = 0
        self.several = (getattr(spec, "num_return_sequences", None) or 1) > 1  # some row has several outputs
        self.logprobs = bool(getattr(spec, "logprobs", None))  # some row asks for log-probabilities
        self.first_failed: ParsedRow | None = None  # its `param` names the field at fault when no row can run

    def rows(self, rows: Iterable[ParsedRow]) -> Iterator[ParsedRow]:
        buffer: list[ParsedRow] = []
        for row in rows:
            buffer.append(row)
            if len(buffer) >= self.chunk:
                yield from self._checked(buffer)
                buffer = []
        yield from self._checked(buffer)

    def _checked(self, rows: list[ParsedRow]) -> list[ParsedRow]:
        good = [r for r in rows if r.error is None]
        for row in good:
            self.several = self.several or (row.input["params"].get("num_return_sequences") or 1) > 1
            self.kinds.add("prompt" if "prompt" in row.input else "messages")
            self.logprobs = self.logprobs or bool(row.input["params"].get("logprobs"))
        for row in rows:  # a failed row's error record carries its pass-through keys too
            if len(self.extra_keys) < EXTRA_KEYS_KEPT:
                self.extra_keys.update(dict.fromkeys((row.input or {}).get("extra", {})))
        if self.tokens is not None and good:
            for row, problem in zip(good, self.tokens.problems([r.input for r in good], self.spec)):
                if problem:
                    row.error = f"{self.where} {row.line}: {problem}"
                    self.too_long += 1
        self.first_failed = self.first_failed or next((r for r in rows if r.error is not None), None)
        return rows

    def summary(self) -> dict[str, Any]:
        return {
            "format": self.spec.input_format,
            "extra_keys": list(self.extra_keys)[:EXTRA_KEYS_KEPT],
            "several_outputs": self.several,
            "input_kinds": sorted(self.kinds, reverse=True),  # prompt before messages
            "logprobs": self.logprobs,
            "token_check": self.tokens is not None,
            "too_long": self.too_long,
        }

    def token_note(self) -> str:
        if self.tokens is None:
            return (
                "token checks left to the worker: the model's tokenizer.json and config.json are not readable "
                "by the API"
            )
        return f"token checks done against a context of {self.tokens.context} tokens: {self.too_long} rows too long"
