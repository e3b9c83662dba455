"""Malformed safetensors files: (name, file bytes, what the error must say).

Shared by test_malformed.py and fuzz/make_corpus.py (which writes them as
the fuzzer's seed corpus).
"""

from __future__ import annotations

import json
import struct


def file(header: bytes | str, data: bytes = b"", *, length: int | None = None, pad: bool = True) -> bytes:
    """A file: 8-byte length (``length`` or the real one), header, data."""
    h = header.encode() if isinstance(header, str) else header
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h) if length is None else length) + h + data


def tensors(entries: dict[str, object], data: bytes) -> bytes:
    return file(json.dumps(entries), data)


def t(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


CASES: list[tuple[str, bytes, str]] = [
    ("empty_file", b"", "too small"),
    ("five_bytes", b"\x10\x00\x00\x00\x00", "too small"),
    ("header_len_u64_max", struct.pack("<Q", 2**64 - 1) + b"{}", "exceeds the limit"),
    ("header_len_over_limit", struct.pack("<Q", 100_000_001) + b"{}      ", "exceeds the limit"),
    ("header_len_past_eof", file("{}", length=1000), "past the end"),
    ("header_len_99mb_tiny_file", file("{}", length=99_999_999), "past the end"),
    ("not_utf8", file(b'{"\xff\xfe": 1}'), "not UTF-8"),
    ("nul_in_header", file(b'{"a\x00": 1}'), "not valid JSON"),
    ("starts_with_bracket", file("[]"), "does not start with '{'"),
    ("starts_with_space", file(' {"a": 1}'), "does not start with '{'"),
    ("truncated_json", file('{"a": {"dtype": "F32"'), "not valid JSON"),
    ("tensor_not_object", file('{"a": 1}'), "not valid JSON"),
    ("missing_offsets", file('{"a": {"dtype": "F32", "shape": [1]}}'), "data_offsets"),
    ("unknown_dtype", tensors({"a": t("F9", [1], 0, 1)}, b"\0"), "unknown dtype"),
    ("torch_dtype_name", tensors({"a": t("float32", [1], 0, 4)}, b"\0" * 4), "unknown dtype"),
    ("negative_dim", file('{"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}', b"\0"), "not valid JSON"),
    ("float_dim", file('{"a": {"dtype": "U8", "shape": [1.5], "data_offsets": [0, 1]}}', b"\0"), "not valid JSON"),
    ("huge_number", file('{"a": {"dtype": "U8", "shape": [1e400], "data_offsets": [0, 1]}}', b"\0"), "not valid JSON"),
    ("three_offsets", file('{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}}', b"\0"), "not valid JSON"),
    ("reversed_offsets", tensors({"a": t("U8", [4], 4, 0)}, b"\0" * 4), "end before they start"),
    ("offsets_out_of_range", tensors({"a": t("U8", [1000], 0, 1000)}, b"\0" * 4), "shorter than"),
    ("offsets_near_u64_max", tensors({"a": t("U8", [1], 2**64 - 2, 2**64 - 1)}, b"\0"), "unused bytes"),
    ("overlap", tensors({"a": t("U8", [4], 0, 4), "b": t("U8", [4], 2, 6)}, b"\0" * 6), "overlaps"),
    ("same_range_twice", tensors({"a": t("F32", [1], 0, 4), "b": t("F32", [1], 0, 4)}, b"\0" * 4), "overlaps"),
    ("gap", tensors({"a": t("U8", [2], 0, 2), "b": t("U8", [2], 4, 6)}, b"\0" * 6), "unused bytes"),
    ("gap_at_start", tensors({"a": t("U8", [2], 2, 4)}, b"\0" * 4), "unused bytes"),
    ("shape_dtype_mismatch", tensors({"a": t("F32", [2, 2], 0, 8)}, b"\0" * 8), "needs 16 bytes"),
    ("scalar_too_long", tensors({"a": t("F64", [], 0, 16)}, b"\0" * 16), "needs 8 bytes"),
    ("f4_half_byte", tensors({"a": t("F4", [3], 0, 2)}, b"\0" * 2), "not whole"),
    ("shape_overflow", tensors({"a": t("U8", [2**32, 2**32, 2**32], 0, 1)}, b"\0"), "overflows"),
    ("duplicate_name", file('{"a": ' + json.dumps(t("U8", [1], 0, 1)) + ', "a": ' + json.dumps(t("U8", [1], 1, 2)) + "}", b"\0\0"), "duplicate name"),  # fmt: skip
    ("rank_65", tensors({"a": t("U8", [1] * 65, 0, 1)}, b"\0"), "more than 64 dimensions"),
    ("trailing_bytes", tensors({"a": t("U8", [4], 0, 4)}, b"\0" * 5), "has bytes past"),
    ("truncated_data", tensors({"a": t("F32", [256], 0, 1024)}, b"\0" * 1000), "shorter than"),
    ("metadata_not_strings", file('{"__metadata__": {"a": 1}}'), "not valid JSON"),
    ("metadata_duplicate_key", file('{"__metadata__": {"a": "1", "a": "2"}}'), "duplicate name"),
    ("deep_nesting", file('{"a": ' + "[" * 5000 + "]" * 5000 + "}"), "not valid JSON"),
    ("deep_nesting_in_skipped_field", file('{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": ' + "[" * 200 + "]" * 200 + "}}", b"\0"), "nested deeper"),  # fmt: skip
    ("many_dims_in_huge_list", file('{"a": {"dtype": "U8", "shape": [' + ",".join(["1"] * 20000) + '], "data_offsets": [0, 1]}}', b"\0"), "more than 64"),  # fmt: skip
]

VALID: list[tuple[str, bytes]] = [
    ("valid_empty", file("{}")),
    ("valid_metadata_only", file('{"__metadata__": {"format": "pt"}}')),
    ("valid_metadata_null", file('{"__metadata__": null}')),
    ("valid_two", tensors({"b": t("F32", [2], 2, 10), "a": t("BF16", [], 0, 2)}, b"\1" * 10)),
    ("valid_empty_tensors", tensors({"e": t("F64", [0, 4], 0, 0), "f": t("I8", [0], 0, 0)}, b"")),
    ("valid_f4", tensors({"q": t("F4", [2, 3], 0, 3)}, b"\x12\x34\x56")),
]
