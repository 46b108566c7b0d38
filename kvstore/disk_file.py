"""One block on a store node's disk tier: its file name, header and atomic write/read.

A block file is a small header, the block's index key, then the payload::

    magic b"TKVB" | version u16 | key length u16 | payload length u64 | xxh3-64 u64
    | key (UTF-8) | payload

(little-endian). The checksum is the index's (xxh3-64 of the payload, the same value
the client verifies, kvstore/transport.py). Files are written under a temporary name
and renamed into place (``os.replace``), so a reader or a restarted node sees either
no file or a whole one; a file cut short by a crash before the data reached the device
is caught by its length or checksum and dropped. Blocking calls: run them off the
event loop (kvstore/disk_tier.py).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

MAGIC = b"TKVB"
VERSION = 1
HEADER = struct.Struct("<4sHHQQ")
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"


class BlockFileError(ValueError):
    """A block file that cannot be served: ``reason`` is ``truncated``, ``checksum``
    or ``header`` (bad magic, version, key)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class BlockHeader:
    """A block file's header.

    Attributes:
        key: the block's index key string (``BlockKey.redis_key``).
        size_bytes: payload bytes.
        checksum: xxh3-64 of the payload, hex (as in the index entry).
    """

    key: str
    size_bytes: int
    checksum: str

    def encode(self) -> bytes:
        raw = self.key.encode()
        return HEADER.pack(MAGIC, VERSION, len(raw), self.size_bytes, int(self.checksum, 16)) + raw

    @property
    def payload_offset(self) -> int:
        """Byte offset of the payload in the file."""
        return HEADER.size + len(self.key.encode())


def block_path(root: Path, key: str) -> Path:
    """Where block ``key`` lives under ``root``: one folder per last two hex digits of
    the block hash (keeps folders small), the file named after the key's hash part."""
    tail = key.rsplit(":", 2)
    name = f"{tail[-2]}-{tail[-1]}" if len(tail) == 3 else key.replace(":", "-")
    return root / name[-2:] / (name + SUFFIX)


def write_block(root: Path, header: BlockHeader, payload: bytes | memoryview) -> int:
    """Write one block file atomically (temporary file, then rename); returns its size.

    NOTE: no fsync per file: the tier is a cache, a file torn by a power cut is found
    by its length or checksum and dropped when the node restarts, and a flush per block
    would cost a device round trip on every eviction.

    Raises:
        OSError: the write failed (full device, read-only, permissions).
    """
    path = block_path(root, header.key)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(TMP_SUFFIX)
    head = header.encode()
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(head) + header.size_bytes


def read_header(f: object, path: Path) -> BlockHeader:
    """Parse the header at the start of open file ``f`` (binary, at offset 0).

    Raises:
        BlockFileError: truncated or not a block file of this version.
    """
    raw = f.read(HEADER.size)  # type: ignore[attr-defined]
    if len(raw) < HEADER.size:
        raise BlockFileError("truncated", f"{path}: header cut short")
    magic, version, key_len, size, digest = HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION:
        raise BlockFileError("header", f"{path}: not a v{VERSION} block file")
    key_raw = f.read(key_len)  # type: ignore[attr-defined]
    if len(key_raw) < key_len:
        raise BlockFileError("truncated", f"{path}: key cut short")
    try:
        key = key_raw.decode()
    except UnicodeDecodeError as exc:
        raise BlockFileError("header", f"{path}: key is not UTF-8") from exc
    return BlockHeader(key, size, f"{digest:016x}")


def read_block_into(path: Path, key: str, out: np.ndarray) -> None:
    """Read block ``key``'s payload from ``path`` into ``out`` (uint8, the block's size)
    and verify its length and checksum against the file's header.

    Raises:
        BlockFileError: truncated, wrong key or size, or checksum mismatch.
        OSError: the file cannot be opened or read (e.g. removed).
    """
    with open(path, "rb") as f:
        header = read_header(f, path)
        if header.key != key or header.size_bytes != out.nbytes:
            raise BlockFileError(
                "header", f"{path}: holds {header.key} of {header.size_bytes} bytes, not {key}"
            )
        n = f.readinto(out.data)
        if n != out.nbytes or f.read(1):
            raise BlockFileError(
                "truncated", f"{path}: payload of {n} bytes, header says {out.nbytes}"
            )
    if xxhash.xxh3_64_hexdigest(out.data) != header.checksum:
        raise BlockFileError("checksum", f"{path}: checksum mismatch")


def verify_file(path: Path) -> tuple[BlockHeader, int]:
    """Read a whole block file and check it (a restarted node's scan).

    Returns:
        (its header, its size on disk in bytes).

    Raises:
        BlockFileError: truncated, trailing bytes, bad header or checksum mismatch.
        OSError: unreadable.
    """
    with open(path, "rb") as f:
        header = read_header(f, path)
        payload = f.read(header.size_bytes + 1)
    if len(payload) != header.size_bytes:
        raise BlockFileError(
            "truncated", f"{path}: payload of {len(payload)} bytes, header says {header.size_bytes}"
        )
    if xxhash.xxh3_64_hexdigest(payload) != header.checksum:
        raise BlockFileError("checksum", f"{path}: checksum mismatch")
    if block_path(path.parent.parent, header.key) != path:
        raise BlockFileError("header", f"{path}: holds {header.key}, another file's key")
    return header, header.payload_offset + header.size_bytes
