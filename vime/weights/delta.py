"""Weight deltas: a new version encoded against its parent, file by file (pure functions, no manifests).

A delta of one file is a ``<name>.vdelta`` container::

    b"VIMEDLT1" | u64 little-endian header length | header (JSON, ``FileDelta``) | frames

Two kinds:

- ``xor`` (a ``.safetensors`` file whose header is byte-identical to the parent's, hence the same
  tensors with the same dtypes, shapes and offsets): the file is cut into chunks (the safetensors
  header, then one chunk per tensor in offset order). Each chunk holds ``new XOR parent``, with
  the bytes of each element regrouped by position (all first bytes, then all second bytes, ...,
  as blosc's "shuffle" does: a small optimizer step leaves signs and exponents unchanged, so
  those planes are zeros), compressed in independent frames of at most ``BLOCK`` bytes.
- ``raw`` (any other file: ``config.json``, a safetensors file whose layout changed, a file the
  parent lacks): the new file, compressed in frames.

Decoding the container against the parent's file reproduces the new file byte for byte; the
caller checks that with the new file's sha256 (``vime.weights.disk``). Memory stays bounded by
a few ``BLOCK``-sized buffers: files are read through memory maps.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable, Iterator

import msgspec
import numpy as np

from vime.errors import InternalError

MAGIC = b"VIMEDLT1"
SUFFIX = ".vdelta"
BLOCK = 16 << 20  # bytes of one frame before compression (a multiple of every element size)
ZLIB_LEVEL = 1  # float32 model after an AdamW step: 53% of the full size; level 6: 51% in ~1.8x the time

# safetensors dtype -> element size in bytes (unknown dtypes fall back to 1: no regrouping)
ELEMENT_SIZE = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


class DeltaError(InternalError, ValueError):
    """A delta container that cannot be decoded (truncated, wrong parent, unknown codec)."""


class Chunk(msgspec.Struct, array_like=True, frozen=True):
    name: str  # tensor name, "__header__" or "__file__"
    offset: int  # where the chunk's bytes start in the new file
    length: int  # bytes of the new file it covers
    itemsize: int  # element size the bytes were regrouped by (1: not regrouped)
    frames: list[int]  # compressed size of each frame, in order


class FileDelta(msgspec.Struct, frozen=True):
    kind: str  # xor | raw
    codec: str  # zlib
    size: int  # bytes of the new (reconstructed) file
    chunks: list[Chunk]


def _zlib_compress(data: bytes) -> bytes:
    return zlib.compress(data, ZLIB_LEVEL)


# codec name -> (compress, decompress). zstd would go here if `zstandard` were a dependency.
CODECS: dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]] = {
    "zlib": (_zlib_compress, zlib.decompress),
}


def safetensors_layout(path: str) -> tuple[bytes, list[tuple[str, int, int, int]]]:
    """(header bytes including the 8-byte length, [(tensor, start, end, itemsize)] in file
    offsets, sorted by start)."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise DeltaError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", prefix)
        if length > os.path.getsize(path) - 8:
            raise DeltaError(f"{path}: not a safetensors file (header length {length} past the end)")
        header = f.read(length)
    try:
        entries = json.loads(header)
    except ValueError as error:
        raise DeltaError(f"{path}: unreadable safetensors header ({error})") from None
    base = 8 + length
    tensors = [
        (name, base + info["data_offsets"][0], base + info["data_offsets"][1], ELEMENT_SIZE.get(info.get("dtype"), 1))
        for name, info in entries.items()
        if name != "__metadata__"
    ]
    return prefix + header, sorted(tensors, key=lambda t: t[1])


def _chunks_of(layout: tuple[bytes, list[tuple[str, int, int, int]]], size: int) -> list[tuple[str, int, int, int]]:
    """(name, offset, length, itemsize) covering [0, size) without gaps."""
    header, tensors = layout
    out = [("__header__", 0, len(header), 1)]
    position = len(header)
    for name, start, end, itemsize in tensors:
        if start < position or end < start or end > size:
            raise DeltaError(f"tensor {name} overlaps another or lies outside the file")
        if start > position:
            out.append(("__gap__", position, start - position, 1))
        out.append((name, start, end - start, itemsize if (end - start) % itemsize == 0 else 1))
        position = end
    if position < size:
        out.append(("__gap__", position, size - position, 1))
    return out


def _shuffle(block: np.ndarray, itemsize: int) -> np.ndarray:
    """[a0 a1 a2 a3 b0 b1 b2 b3 ...] -> [a0 b0 ... a1 b1 ... a2 b2 ... a3 b3 ...] (flat)."""
    return block if itemsize == 1 else np.ascontiguousarray(block.reshape(-1, itemsize).T).reshape(-1)


def _unshuffle(block: np.ndarray, itemsize: int) -> np.ndarray:
    return block if itemsize == 1 else np.ascontiguousarray(block.reshape(itemsize, -1).T).reshape(-1)


def _blocks(length: int) -> Iterator[tuple[int, int]]:
    for start in range(0, length, BLOCK):
        yield start, min(BLOCK, length - start)


def _map(path: str) -> np.ndarray:
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


def xor_compatible(parent: str | None, new: str) -> bool:
    """True when ``new`` can be encoded as an XOR against ``parent`` (same safetensors layout)."""
    if parent is None or not os.path.exists(parent) or not new.endswith(".safetensors"):
        return False
    if os.path.getsize(parent) != os.path.getsize(new):
        return False
    try:
        return safetensors_layout(parent)[0] == safetensors_layout(new)[0]
    except DeltaError:
        return False


def encode_file(parent: str | None, new: str, out: str, *, codec: str = "zlib") -> FileDelta:
    """Write the delta of ``new`` against ``parent`` (None: no parent file) to ``out``."""
    compress = CODECS[codec][0]
    size = os.path.getsize(new)
    new_bytes = _map(new)
    if xor_compatible(parent, new):
        kind, parent_bytes = "xor", _map(parent)
        spans = _chunks_of(safetensors_layout(new), size)
    else:
        kind, parent_bytes = "raw", None
        spans = [("__file__", 0, size, 1)]
    chunks, payload_path = [], out + ".payload"
    with open(payload_path, "wb") as payload:
        for name, offset, length, itemsize in spans:
            frames = []
            for start, count in _blocks(length):
                block = new_bytes[offset + start : offset + start + count]
                if parent_bytes is not None:
                    block = np.bitwise_xor(block, parent_bytes[offset + start : offset + start + count])
                frame = compress(_shuffle(np.asarray(block), itemsize).tobytes())
                payload.write(frame)
                frames.append(len(frame))
            chunks.append(Chunk(name, offset, length, itemsize, frames))
    header = msgspec.json.encode(FileDelta(kind=kind, codec=codec, size=size, chunks=chunks))
    try:
        with open(out, "wb") as f, open(payload_path, "rb") as payload:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            while data := payload.read(1 << 20):
                f.write(data)
    finally:
        os.remove(payload_path)
    return FileDelta(kind=kind, codec=codec, size=size, chunks=chunks)


def read_header(path: str) -> tuple[FileDelta, int]:
    """(the container's header, offset of its first frame)."""
    with open(path, "rb") as f:
        prefix = f.read(len(MAGIC) + 8)
        if len(prefix) != len(MAGIC) + 8 or not prefix.startswith(MAGIC):
            raise DeltaError(f"{path}: not a vime delta (bad magic)")
        (length,) = struct.unpack("<Q", prefix[len(MAGIC) :])
        try:
            header = msgspec.json.decode(f.read(length), type=FileDelta)
        except msgspec.DecodeError as error:
            raise DeltaError(f"{path}: unreadable delta header ({error})") from None
    return header, len(MAGIC) + 8 + length


def decode_file(parent: str | None, delta: str, out: str) -> FileDelta:
    """Rebuild the new file from ``parent`` and the container ``delta`` into ``out``."""
    header, position = read_header(delta)
    if header.codec not in CODECS:
        raise DeltaError(f"{delta}: unknown codec {header.codec!r}")
    decompress = CODECS[header.codec][1]
    parent_bytes = None
    if header.kind == "xor":
        if parent is None or not os.path.exists(parent):
            raise DeltaError(f"{delta}: an xor delta needs the parent file, which is missing")
        if os.path.getsize(parent) != header.size:
            raise DeltaError(
                f"{delta}: parent {parent} has {os.path.getsize(parent)} bytes, "
                f"the delta was made against {header.size}"
            )
        parent_bytes = _map(parent)
    elif header.kind != "raw":
        raise DeltaError(f"{delta}: unknown delta kind {header.kind!r}")
    written = 0
    with open(delta, "rb") as source, open(out, "wb") as target:
        source.seek(position)
        for chunk in header.chunks:
            if chunk.offset != written:
                raise DeltaError(f"{delta}: chunk {chunk.name} starts at {chunk.offset}, expected {written}")
            blocks = list(_blocks(chunk.length))
            if len(blocks) != len(chunk.frames):
                raise DeltaError(f"{delta}: chunk {chunk.name} has {len(chunk.frames)} frames, expected {len(blocks)}")
            for (start, count), frame_size in zip(blocks, chunk.frames):
                frame = source.read(frame_size)
                try:
                    data = decompress(frame)
                except zlib.error as error:
                    raise DeltaError(f"{delta}: chunk {chunk.name} does not decompress ({error})") from None
                if len(frame) != frame_size or len(data) != count:
                    raise DeltaError(f"{delta}: chunk {chunk.name} is truncated")
                block = _unshuffle(np.frombuffer(data, dtype=np.uint8), chunk.itemsize)
                if parent_bytes is not None:
                    at = chunk.offset + start
                    block = np.bitwise_xor(block, parent_bytes[at : at + count])
                target.write(block.tobytes())
            written += chunk.length
    if written != header.size:
        raise DeltaError(f"{delta}: chunks cover {written} bytes of {header.size}")
    return header


def encode_folder(parent_dir: str, new_dir: str, out_dir: str, *, codec: str = "zlib") -> dict[str, FileDelta]:
    """One ``<name>.vdelta`` in ``out_dir`` for every file of ``new_dir``; returns {name: header}."""
    os.makedirs(out_dir, exist_ok=True)
    result = {}
    for name in sorted(os.listdir(new_dir)):
        parent = os.path.join(parent_dir, name)
        result[name] = encode_file(
            parent if os.path.exists(parent) else None,
            os.path.join(new_dir, name),
            os.path.join(out_dir, name + SUFFIX),
            codec=codec,
        )
    return result


def decode_folder(parent_dir: str, delta_dir: str, out_dir: str, names: list[str]) -> None:
    """Rebuild the files ``names`` of the new version from ``parent_dir`` and ``delta_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    for name in names:
        parent = os.path.join(parent_dir, name)
        decode_file(
            parent if os.path.exists(parent) else None,
            os.path.join(delta_dir, name + SUFFIX),
            os.path.join(out_dir, name),
        )
