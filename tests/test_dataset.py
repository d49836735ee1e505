"""Structural checks of dataset rows (core.dataset.parse_jsonl): good rows, failed rows with `line N:` reasons, refusals.

Messages are asserted exactly, so a changed message is noticed here.
"""

from __future__ import annotations

import io

import pytest

from core.dataset import ParsedRow, parse_jsonl
from core.errors import InvalidInput

EMPTY = "the dataset is empty: expected one JSON object per line with 'prompt' or 'messages'"
ONE_OF = "a row needs exactly one of 'prompt' (a string) or 'messages' (a list of messages)"
CUSTOM_ID = "custom_id must be a non-empty string of at most 255 printable characters"
BAD_MESSAGE = "must be an object with 'role' (one of system, user, assistant, tool, developer) and 'content'"


def parse(data: bytes) -> list[ParsedRow]:
    """Parse like the API does: a binary file read line by line (newlines kept)."""
    return list(parse_jsonl(io.BytesIO(data)))


def test_prompt_and_messages_rows_parse_into_the_stored_form():
    """A prompt row and a messages row become {prompt|messages, params: {}, extra: {}} with 0-based idx and 1-based line."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rows = parse(
        b'{"prompt": "Hello"}\n'
        b'{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}\n'
    )
    assert rows == [
        ParsedRow(0, 1, "line-1", {"prompt": "Hello", "params": {}, "extra": {}}),
        ParsedRow(1, 2, "line-2", {"messages": messages, "params": {}, "extra": {}}),
    ]


def test_every_role_is_accepted():
    """system, user, assistant, tool and developer messages are all valid."""
    roles = ["system", "user", "assistant", "tool", "developer"]
    line = '{"messages": [' + ", ".join(f'{{"role": "{r}", "content": "x"}}' for r in roles) + "]}\n"
    (row,) = parse(line.encode())
    assert row.error is None
    assert [m["role"] for m in row.input["messages"]] == roles


def test_custom_id_is_kept_or_generated_from_the_physical_line():
    """A given custom_id is kept; a missing one becomes line-N, N the 1-based physical line (blank lines count, are skipped)."""
    rows = parse(
        b'{"prompt": "a"}\n\n   \n{"prompt": "b", "custom_id": "mine"}\n\r\n{"prompt": "c"}'
    )  # no trailing newline on the last line
    assert [(r.idx, r.line, r.custom_id) for r in rows] == [(0, 1, "line-1"), (1, 4, "mine"), (2, 6, "line-6")]
    assert all(r.error is None for r in rows)
    assert "custom_id" not in rows[1].input["extra"]


def test_pass_through_keys_are_kept_under_extra_and_overrides_under_params():
    """Unknown keys go unchanged to extra; sampling parameters become validated per-row params (stop string → list)."""
    (row,) = parse(
        b'{"prompt": "p", "temperature": 0.5, "max_new_tokens": 12, "stop": "END", "seed": null, '
        b'"meta": {"a": [1, 2]}, "tag": "t", "params": "mine"}\n'
    )
    assert row.error is None
    assert row.input == {
        "prompt": "p",
        "params": {"temperature": 0.5, "max_new_tokens": 12, "stop": ["END"]},
        "extra": {"meta": {"a": [1, 2]}, "tag": "t", "params": "mine"},
    }


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b'{"prompt": "x"', "invalid JSON: Expecting ',' delimiter (column 15)"),
        (b"{prompt: x}", "invalid JSON: Expecting property name enclosed in double quotes (column 2)"),
        (b'\xff{"prompt": "x"}', "not valid UTF-8 at byte 0: save the file as UTF-8"),
        (b'{"prompt": "caf\xe9"}', "not valid UTF-8 at byte 15: save the file as UTF-8"),  # a 0-based byte offset
        (b"[1, 2]", "expected a JSON object, got list"),
        (b'"just a string"', "expected a JSON object, got str"),
        (b"42", "expected a JSON object, got int"),
        (b"null", "expected a JSON object, got NoneType"),
        (b'{"custom_id": "c", "tag": 1}', ONE_OF),
        (b'{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}', ONE_OF),
        (b'{"prompt": null, "tag": 1}', f"{ONE_OF}; this row's 'prompt' is empty"),
        (b'{"prompt": ""}', "'prompt' must be a non-empty string"),
        (b'{"prompt": 5}', "'prompt' must be a non-empty string, not a number"),
        (b'{"messages": []}', "'messages' must be a non-empty list of {role, content} objects"),
        (b'{"messages": "hi"}', "'messages' must be a non-empty list of {role, content} objects, not a string"),
        (b'{"messages": [{"role": "robot", "content": "x"}]}', f"messages[0] {BAD_MESSAGE}"),
        (b'{"messages": [{"role": "user", "content": "x"}, {"role": "user"}]}', f"messages[1] {BAD_MESSAGE}"),
        (b'{"messages": [{"role": "user", "content": 3}]}', f"messages[0] {BAD_MESSAGE}"),
        (b'{"messages": ["hi"]}', f"messages[0] {BAD_MESSAGE}"),
        (
            b'{"prompt": "x", "temperature": -1}',
            "invalid per-row parameter: temperature: Input should be greater than or equal to 0",
        ),
        (
            b'{"prompt": "x", "max_new_tokens": 0, "top_p": 2}',
            "invalid per-row parameter: max_new_tokens: Input should be greater than or equal to 1; "
            "top_p: Input should be less than or equal to 1",
        ),
        (b'{"prompt": "x", "stop": 5}', "invalid per-row parameter: stop: Input should be a valid list, not 5"),
        (b'{"prompt": "x", "custom_id": ""}', CUSTOM_ID),
        (b'{"prompt": "x", "custom_id": 7}', f"{CUSTOM_ID}, not a number"),
        (b'{"prompt": "x", "custom_id": ["a"]}', f"{CUSTOM_ID}, not a list"),
        (b'{"prompt": "x", "custom_id": "' + b"c" * 256 + b'"}', CUSTOM_ID),
    ],
)
def test_a_bad_row_fails_alone_with_its_line_and_reason(line, reason):
    """A bad row becomes a failed row 'line N: reason' keeping its raw text and its pass-through keys (`tag`);
    the good rows around it stay good."""
    rows = parse(b'{"prompt": "before"}\n\n' + line + b'\n{"prompt": "after"}\n')
    assert [r.error for r in rows] == [None, f"line 3: {reason}", None]
    assert [(r.idx, r.line) for r in rows] == [(0, 1), (1, 3), (2, 4)]
    bad = rows[1]
    extra = {"extra": {"tag": 1}} if b'"tag"' in line else {}
    assert bad.input == {"raw": line.decode("utf-8", "replace") + "\n", **extra}
    assert rows[0].input["prompt"] == "before" and rows[2].input["prompt"] == "after"


def test_a_bad_row_keeps_its_own_custom_id_when_it_has_a_valid_one():
    """A row failing after its custom_id was read is reported under that id; an unreadable row under line-N."""
    rows = parse(b'{"custom_id": "q1", "messages": [{"role": "robot", "content": "x"}]}\n{"prompt": \n')
    assert [(r.custom_id, r.error) for r in rows] == [
        ("q1", f"line 1: messages[0] {BAD_MESSAGE}"),
        ("line-2", "line 2: invalid JSON: Expecting value (column 12)"),
    ]


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b""])
def test_the_column_of_a_truncated_line_points_at_its_end_whatever_the_line_ending(ending):
    """A line cut short reports the column where it ends, not column 1 of the line ending after it."""
    (row,) = parse(b'{"prompt": "x"' + ending)
    assert row.error == "line 1: invalid JSON: Expecting ',' delimiter (column 15)"


def test_the_raw_text_of_a_bad_row_is_truncated():
    """A huge bad line is stored as its first 2000 bytes only."""
    (row,) = parse(b'{"prompt": "' + b"x" * 5000 + b"\n")
    assert row.error == "line 1: invalid JSON: Unterminated string starting at (column 12)"
    assert row.input == {"raw": '{"prompt": "' + "x" * (2000 - 12)}


@pytest.mark.parametrize("data", [b"", b"\n", b"\n  \n\r\n\t\n"])
def test_an_empty_dataset_is_refused(data):
    """An empty file, or one of blank lines only, raises InvalidInput('the dataset is empty…')."""
    with pytest.raises(InvalidInput) as info:
        parse(data)
    assert str(info.value) == EMPTY


def test_a_dataset_of_only_bad_rows_is_not_empty():
    """Rows that all failed are still rows: they come back failed instead of an empty-dataset error."""
    rows = parse(b"[]\n{}\n")
    assert [r.error for r in rows] == ["line 1: expected a JSON object, got list", f"line 2: {ONE_OF}"]


def test_a_duplicate_custom_id_is_refused_naming_both_lines():
    """Two rows with one custom_id refuse the dataset, naming the id and both physical lines."""
    with pytest.raises(InvalidInput) as info:
        parse(b'{"prompt": "a", "custom_id": "x"}\n\n{"prompt": "b"}\n{"prompt": "c", "custom_id": "x"}\n')
    assert str(info.value) == ("duplicate custom_id 'x' on lines 1 and 4: custom_ids must be unique within a dataset")


def test_a_given_custom_id_equal_to_a_generated_one_is_a_duplicate():
    """An explicit custom_id 'line-3' collides with the id generated for physical line 3."""
    with pytest.raises(InvalidInput) as info:
        parse(b'{"prompt": "a", "custom_id": "line-3"}\n\n{"prompt": "b"}\n')
    assert str(info.value) == (
        "duplicate custom_id 'line-3' on lines 1 and 3: custom_ids must be unique within a dataset"
    )


def test_read_records_gives_every_format_its_place(tmp_path):
    """The format-agnostic reader (reused by fine-tunes): the same two rows from JSONL, CSV and Parquet, each with
    its 1-based line (CSV counts the header) or 0-based row, and the data with mapped column names."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from core.dataset import read_records

    (tmp_path / "a.jsonl").write_text('{"q": "x"}\n\n{"q": "y"}\n')
    (tmp_path / "a.csv").write_text("q\nx\ny\n")
    pq.write_table(pa.table({"q": ["x", "y"]}), tmp_path / "a.parquet")
    places = {
        fmt: [(r.pos, r.data) for r in read_records(tmp_path / f"a.{fmt}", fmt, columns={"prompt": "q"})]
        for fmt in ("jsonl", "csv", "parquet")
    }
    assert places == {
        "jsonl": [(1, {"prompt": "x"}), (3, {"prompt": "y"})],
        "csv": [(2, {"prompt": "x"}), (3, {"prompt": "y"})],
        "parquet": [(0, {"prompt": "x"}), (1, {"prompt": "y"})],
    }
