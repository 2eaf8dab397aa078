"""One UTF-8 check for the text files users hand to profiling (`occult profile --text`, `RoutingProfile.collect`):
a byte that is not UTF-8 is an error naming the file and the byte's offset before any model runs on the text,
not a `UnicodeDecodeError` from deep inside tokenisation."""

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


def _decode(decoder, chunk: bytes, offset: int, named: str) -> None:
    """Feed `chunk` (file offset `offset`; empty: the end of the file) to `decoder`; an error counts the bytes the
    decoder held back from the previous chunk, where a character cut by the chunk boundary starts."""
    held = decoder.getstate()[0]
    try:
        decoder.decode(chunk, final=not chunk)
    except UnicodeDecodeError as error:
        data = held + chunk
        raise ValueError(
            f"{named} is not UTF-8: byte {offset - len(held) + error.start} (0x{data[error.start]:02x}) {error.reason}"
        ) from None
