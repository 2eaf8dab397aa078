"""One UTF-8 error for the text files users hand to profiling: a byte that is not UTF-8 names the file and the byte's
offset before any model runs on the text, not a `UnicodeDecodeError` from deep inside tokenisation. `check_utf8`
decodes in chunks (`occult profile --text`, before the model loads); `read_utf8` reads the text once, whole
(`RoutingProfile.collect`, which keeps it all), as Python's text mode and `datasets`' text builder read it: a file
saved on Windows (a byte-order mark, "\r\n" line ends) then gives the same documents and tokens as the same text saved
elsewhere, and `occult profile --text` the same as `--dataset`."""

from __future__ import annotations

import codecs


def check_utf8(path: str, named: str, chunk_bytes: int = 2**20) -> None:
    """Decode the file `path` in chunks (a corpus may be larger than memory); the first byte that is not UTF-8 raises
    a `ValueError` that starts with `named` (e.g. "--text 'a.txt'") and gives the byte's file offset."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # of the chunk's first byte; the decoder may still hold the start of a character before it
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(chunk_bytes), b""):
            _decode(decoder, chunk, offset, named)
            offset += len(chunk)
        _decode(decoder, b"", offset, named)


def read_utf8(path: str, named: str) -> str:
    """The text of the file `path`, read once and whole (for a caller that keeps it all): a leading byte-order mark
    dropped and "\r\n" or "\r" read as "\n" (universal newlines), or a "\r" would end every line's document as one
    more token; a byte that is not UTF-8 raises `check_utf8`'s error."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _not_utf8(named, error.start, raw[error.start], error.reason) from None
    return text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def _decode(decoder, chunk: bytes, offset: int, named: str) -> None:
    """Feed `chunk` (file offset `offset`; empty: the end of the file) to `decoder`; an error counts the bytes the
    decoder held back from the previous chunk, where a character cut by the chunk boundary starts."""
    held = decoder.getstate()[0]
    try:
        decoder.decode(chunk, final=not chunk)
    except UnicodeDecodeError as error:
        raise _not_utf8(named, offset - len(held) + error.start, (held + chunk)[error.start], error.reason) from None


def _not_utf8(named: str, offset: int, byte: int, reason: str) -> ValueError:
    return ValueError(f"{named} is not UTF-8: byte {offset} (0x{byte:02x}) {reason}")
