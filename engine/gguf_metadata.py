"""The key/value metadata section of a GGUF file, read without torch and without tensors.

Format (ggml ``docs/gguf.md``, versions 2 and 3, little-endian): magic ``GGUF``, ``uint32``
version, ``uint64`` tensor count, ``uint64`` key/value count, then each pair as a string key
(``uint64`` length + UTF-8 bytes), a ``uint32`` value type and the value; an array value is a
``uint32`` element type, a ``uint64`` length and the elements. Tensor infos and data follow
and are not read.

Why our own reader: ``gguf.GGUFReader`` builds numpy views for every element of every field
and every tensor, which makes it the bulk of the router's start-up on the default model
(two arrays of ~49k strings); this reads each string once with ``struct``.
"""

from __future__ import annotations

import mmap
import struct

import numpy as np

_MAGIC = b"GGUF"
_STRING = 8
_ARRAY = 9
_BOOL = 7
#: value type -> struct format of one scalar (little-endian)
_SCALARS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}

MetadataValue = int | float | bool | str | list[int] | list[float] | list[bool] | list[str]


class _Cursor:
    """Sequential little-endian reads over a buffer; a read past its end is a ValueError."""

    def __init__(self, buf: mmap.mmap | bytes, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def take(self, fmt: str) -> int | float | bool:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"gguf file {self.path!r}: truncated metadata")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = int(self.take("<Q"))
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError(f"gguf file {self.path!r}: truncated metadata")
        text = bytes(self.buf[self.pos:end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, vtype: int) -> MetadataValue:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = int(self.take("<I")), int(self.take("<Q"))
            if etype == _STRING:
                return [self.string() for _ in range(n)]
            if etype not in _SCALARS:
                raise ValueError(f"gguf file {self.path!r}: unsupported array element type {etype}")
            dtype = np.dtype(_SCALARS[etype])
            end = self.pos + n * dtype.itemsize
            if end > len(self.buf):
                raise ValueError(f"gguf file {self.path!r}: truncated metadata")
            items = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
            self.pos = end
            return [bool(x) for x in items] if etype == _BOOL else items.tolist()
        if vtype not in _SCALARS:
            raise ValueError(f"gguf file {self.path!r}: unsupported value type {vtype}")
        return self.take(_SCALARS[vtype])


def read_gguf_metadata(path: str) -> dict[str, MetadataValue]:
    """Every metadata key of a GGUF file with its value (arrays as Python lists).

    Args:
        path: a local ``.gguf`` file.

    Returns:
        ``{key: value}`` in file order, e.g. ``"general.architecture" -> "llama"``,
        ``"tokenizer.ggml.tokens" -> [str, ...]``.

    Raises:
        ValueError: naming the file when it is not GGUF, is a version other than 2 or 3,
            is big-endian, or its metadata is truncated or holds an unknown type.
        OSError: when the file cannot be opened.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf, path)
        if bytes(buf[:4]) != _MAGIC:
            raise ValueError(f"gguf file {path!r}: not a GGUF file (bad magic)")
        cur.pos = 4
        version = int(cur.take("<I"))
        if version not in (2, 3):
            # A big-endian file reads as a huge little-endian version number.
            raise ValueError(f"gguf file {path!r}: unsupported GGUF version {version} "
                             "(little-endian version 2 or 3 expected)")
        cur.take("<Q")  # tensor count: tensors are not read here
        num_kv = int(cur.take("<Q"))
        out: dict[str, MetadataValue] = {}
        for _ in range(num_kv):
            key = cur.string()
            out[key] = cur.value(int(cur.take("<I")))
        return out
