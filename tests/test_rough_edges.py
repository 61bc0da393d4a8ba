"""Rough edges a new user met (issue 49, item 7): messages that read right, and commands without log noise."""

import pytest

from dpllm.io import JsonlError, read_jsonl


def test_an_unterminated_string_reads_once_at(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "cut')  # the file ends inside a string
    with pytest.raises(JsonlError) as err:
        read_jsonl(path)
    assert str(err.value) == f"{path}:2: not valid JSON (Unterminated string starting at column 10)"
    path.write_text('{"text" "x"}\n')
    with pytest.raises(JsonlError, match=r"d.jsonl:1: not valid JSON \(Expecting ':' delimiter at column 9\)"):
        read_jsonl(path)
