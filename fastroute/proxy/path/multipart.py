"""Find one text field of a ``multipart/form-data`` body without parsing the rest.

The audio endpoints (``/v1/audio/transcriptions``, ``/v1/audio/translations``) carry
their ``model`` as a form field next to the audio file. The proxy forwards the body
byte for byte and needs only that field, so this is a bounded scan, not a parser:
the boundary from the ``Content-Type`` header, then part by part the part's headers
(at most :data:`MAX_PART_HEADER_BYTES`) until the part whose ``Content-Disposition``
names the field; a part's content is skipped with one ``bytes.find`` of the next
delimiter (C speed, nothing copied). At most :data:`MAX_PARTS` parts are looked at.

Why not a parser: the only multipart reader among the dependencies is aiohttp's
``MultipartReader``, which reads from a stream, asynchronously, and copies every part
it passes (the audio file too); the body is already in memory and only one small
field is wanted. ``multipart``/``python-multipart`` are not dependencies.
"""

from __future__ import annotations

from fastroute.errors import FastrouteError

__all__ = [
    "MultipartError",
    "form_field",
    "boundary_of",
    "MAX_PARTS",
    "MAX_PART_HEADER_BYTES",
    "MAX_FIELD_BYTES",
    "MAX_BOUNDARY_BYTES",
]

#: Most parts scanned for the field (a transcription form has about ten).
MAX_PARTS = 64
#: Most bytes of one part's header block.
MAX_PART_HEADER_BYTES = 8 * 1024
#: Most bytes of the field's value.
MAX_FIELD_BYTES = 4 * 1024
#: Longest boundary RFC 2046 allows.
MAX_BOUNDARY_BYTES = 70

_CRLF = b"\r\n"
_HEADERS_END = b"\r\n\r\n"


class MultipartError(FastrouteError, ValueError):
    """A body that is not the ``multipart/form-data`` its ``Content-Type`` announces."""

    status = 400


def boundary_of(content_type: str) -> bytes:
    """The boundary parameter of a ``multipart/form-data`` ``Content-Type`` value.

    Raises
    ------
    MultipartError
        Not ``multipart/form-data``, or no (valid) boundary.
    """
    media, _, params = content_type.partition(";")
    if media.strip().lower() != "multipart/form-data":
        raise MultipartError(
            f"Content-Type must be multipart/form-data, got {media.strip() or 'none'!r}."
        )
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key.strip().lower() == "boundary":
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = value[1:-1]
            if 1 <= len(value) <= MAX_BOUNDARY_BYTES:
                return value.encode("latin-1", "replace")
            break
    raise MultipartError("multipart/form-data without a valid boundary parameter.")


def _field_name(headers: bytes) -> bytes | None:
    """The ``name`` of a part's ``Content-Disposition: form-data`` header."""
    for line in headers.split(_CRLF):
        name, _, value = line.partition(b":")
        if name.strip().lower() != b"content-disposition":
            continue
        for param in value.split(b";")[1:]:
            key, _, val = param.strip().partition(b"=")
            if key.strip().lower() == b"name":
                val = val.strip()
                if len(val) >= 2 and val[:1] == val[-1:] == b'"':
                    val = val[1:-1]
                return val
    return None


def form_field(body: bytes, content_type: str, field: str) -> str | None:
    """The value of the text field ``field`` of a ``multipart/form-data`` body.

    Parameters
    ----------
    body : bytes
        The whole request body.
    content_type : str
        The request's ``Content-Type`` header (carries the boundary).
    field : str
        The form field's name, e.g. ``"model"``.

    Returns
    -------
    str or None
        The field's value (UTF-8), or None if no part of the first :data:`MAX_PARTS`
        is that field.

    Raises
    ------
    MultipartError
        Wrong content type, no opening delimiter, a part's headers unterminated or over
        :data:`MAX_PART_HEADER_BYTES`, a part without its closing delimiter, or the field
        over :data:`MAX_FIELD_BYTES`.
    """
    delimiter = b"--" + boundary_of(content_type)
    wanted = field.encode()
    if body.startswith(delimiter):
        pos = len(delimiter)
    else:  # a preamble before the first delimiter
        at = body.find(_CRLF + delimiter)
        if at < 0:
            raise MultipartError("multipart body without its opening boundary.")
        pos = at + 2 + len(delimiter)
    next_delimiter = _CRLF + delimiter
    for _ in range(MAX_PARTS):
        if body.startswith(b"--", pos):
            return None  # the closing delimiter: no such field
        start = body.find(_CRLF, pos) + 2  # the rest of the delimiter line is padding
        if start < 2:
            raise MultipartError("multipart part without headers.")
        end = body.find(_HEADERS_END, start - 2, start + MAX_PART_HEADER_BYTES)
        if end < 0:
            raise MultipartError(
                f"multipart part headers unterminated within {MAX_PART_HEADER_BYTES} bytes."
            )
        content = end + len(_HEADERS_END)
        close = body.find(next_delimiter, content)
        if close < 0:
            raise MultipartError("multipart part without its closing boundary.")
        if _field_name(body[start:end]) == wanted:
            if close - content > MAX_FIELD_BYTES:
                raise MultipartError(f"form field {field!r} is over {MAX_FIELD_BYTES} bytes.")
            return body[content:close].decode("utf-8", "replace")
        pos = close + len(next_delimiter)
    return None
