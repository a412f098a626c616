"""The bounded multipart scan that finds the audio endpoints' ``model`` field."""

from __future__ import annotations

import pytest

from fastroute.proxy.path.multipart import (
    MAX_FIELD_BYTES,
    MAX_PART_HEADER_BYTES,
    MAX_PARTS,
    MultipartError,
    boundary_of,
    form_field,
)

CT = "multipart/form-data; boundary=XyZ"


def _part(name: str, value: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    head = f"Content-Disposition: {disposition}\r\n"
    if filename:
        head += "Content-Type: audio/wav\r\n"
    return b"--XyZ\r\n" + head.encode() + b"\r\n" + value + b"\r\n"


def _body(*parts: bytes) -> bytes:
    return b"".join(parts) + b"--XyZ--\r\n"


def test_field_after_a_binary_file_part() -> None:
    audio = b"RIFF\r\n--X\r\n\0\xff" * 100  # looks like delimiters, is not one
    body = _body(_part("file", audio, "a.wav"), _part("model", b"whisper-small"))
    assert form_field(body, CT, "model") == "whisper-small"
    assert form_field(body, CT, "language") is None


def test_field_first_quoted_boundary_and_preamble() -> None:
    body = b"preamble\r\n" + _body(_part("model", b"m1"), _part("file", b"\0" * 10, "a.wav"))
    assert form_field(body, 'multipart/form-data; boundary="XyZ"', "model") == "m1"


def test_unquoted_name_and_empty_value() -> None:
    body = b"--XyZ\r\nContent-Disposition: form-data; name=model\r\n\r\n\r\n--XyZ--\r\n"
    assert form_field(body, CT, "model") == ""


@pytest.mark.parametrize(
    ("content_type", "why"),
    [
        ("application/json", "multipart/form-data"),
        ("multipart/form-data", "boundary"),
        ("multipart/form-data; boundary=" + "b" * 71, "boundary"),
    ],
)
def test_bad_content_type(content_type: str, why: str) -> None:
    with pytest.raises(MultipartError, match=why):
        boundary_of(content_type)


def test_malformed_bodies() -> None:
    with pytest.raises(MultipartError, match="opening boundary"):
        form_field(b"no delimiter at all", CT, "model")
    with pytest.raises(MultipartError, match="closing boundary"):
        form_field(b"--XyZ\r\nContent-Disposition: form-data; name=model\r\n\r\nm", CT, "model")
    long_head = b"--XyZ\r\nX-Pad: " + b"a" * MAX_PART_HEADER_BYTES + b"\r\n\r\nv\r\n--XyZ--"
    with pytest.raises(MultipartError, match="headers unterminated"):
        form_field(long_head, CT, "model")
    with pytest.raises(MultipartError, match="over"):
        form_field(_body(_part("model", b"m" * (MAX_FIELD_BYTES + 1))), CT, "model")


def test_at_most_max_parts_are_scanned() -> None:
    filler = [_part(f"f{i}", b"x") for i in range(MAX_PARTS)]
    assert form_field(_body(*filler, _part("model", b"late")), CT, "model") is None
    assert form_field(_body(*filler[1:], _part("model", b"last")), CT, "model") == "last"
