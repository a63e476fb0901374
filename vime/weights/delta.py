"""Weight deltas: a new version encoded against its parent, file by file (pure functions, no manifests).

A delta of one file is a ``<name>.vdelta`` container::

    b"VIMEDLT1" | u64 little-endian header length | header (JSON, ``FileDelta``) | frames

Three kinds:

- ``xor`` (a ``.safetensors`` file whose header is byte-identical to the parent's, hence the same
  tensors with the same dtypes, shapes and offsets): the file is cut into chunks (the safetensors
  header, then one chunk per tensor in offset order). Each chunk holds ``new XOR parent``, with
  the bytes of each element regrouped by position (all first bytes, then all second bytes, ...,
  as blosc's "shuffle" does: a small optimizer step leaves signs and exponents unchanged, so
  those planes are zeros), compressed in independent frames of at most ``BLOCK`` bytes.
- ``overwrite`` (same condition as ``xor``; ``--update-weight-delta-encoding overwrite``): each frame
  holds a bitmap of the bytes that changed and their new values. Larger than ``xor`` but
  idempotent: applying it to the new file again gives the new file (``xor`` would revert it).
- ``raw`` (any other file: ``config.json``, a safetensors file whose layout changed, a file the
  parent lacks): the new file, compressed in frames.

Decoding the container against the parent's file reproduces the new file byte for byte; the
caller checks that with the new file's sha256 (``vime.weights.disk``). Each chunk (a tensor, the
header) also carries a digest of its rebuilt bytes (``--update-weight-delta-checksum``: xxh3-128,
blake3, adler32 or sha256), checked while decoding, so a mismatch names the tensor. Memory stays bounded by
a few ``BLOCK``-sized buffers: files are read through memory maps.
"""

from __future__ import annotations

import hashlib
import importlib.util
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
    digest: str = ""  # FileDelta.checksum of the chunk's rebuilt bytes ("": none, older containers)


class FileDelta(msgspec.Struct, frozen=True):
    kind: str  # xor | overwrite | raw
    codec: str  # zlib
    size: int  # bytes of the new (reconstructed) file
    chunks: list[Chunk]
    checksum: str | None = None  # algorithm of the chunks' digests (CHECKSUMS)


ENCODINGS = ("xor", "overwrite")  # --update-weight-delta-encoding


class _Adler32:
    def __init__(self):
        self.value = 1

    def update(self, data) -> None:
        self.value = zlib.adler32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def _xxh3_128():
    import xxhash

    return xxhash.xxh3_128()


def _blake3():
    import blake3

    return blake3.blake3()


# --update-weight-delta-checksum -> (module it needs or None, factory of an object with update/hexdigest)
CHECKSUMS: dict[str, tuple[str | None, Callable[[], object]]] = {
    "xxh3-128": ("xxhash", _xxh3_128),
    "blake3": ("blake3", _blake3),
    "adler32": (None, _Adler32),
    "sha256": (None, hashlib.sha256),
}


def checksum_available(name: str) -> bool:
    """True when the algorithm ``name`` can run here (xxh3-128 and blake3 need optional packages)."""
    module = CHECKSUMS[name][0]
    return module is None or importlib.util.find_spec(module) is not None


def usable_checksum(name: str) -> str:
    """``name`` where it can run here, else sha256 (as strong a property: an integrity digest)."""
    return name if checksum_available(name) else "sha256"


def _hasher(name: str | None):
    if name is None:
        return None
    if name not in CHECKSUMS:
        raise DeltaError(f"unknown checksum {name!r}")
    return CHECKSUMS[name][1]()


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


def _overwrite_frame(new: np.ndarray, parent: np.ndarray) -> bytes:
    """Bitmap of the bytes that differ (np.packbits order), then their new values."""
    changed = new != parent
    return np.packbits(changed).tobytes() + np.asarray(new)[changed].tobytes()


def _apply_overwrite(data: bytes, parent: np.ndarray, count: int, where: str) -> np.ndarray:
    mask_bytes = (count + 7) // 8
    if len(data) < mask_bytes:
        raise DeltaError(f"{where} is truncated")
    changed = np.unpackbits(np.frombuffer(data[:mask_bytes], dtype=np.uint8), count=count).astype(bool)
    values = np.frombuffer(data[mask_bytes:], dtype=np.uint8)
    if len(values) != int(changed.sum()):
        raise DeltaError(f"{where}: {len(values)} new values for {int(changed.sum())} changed bytes")
    block = np.array(parent, dtype=np.uint8, copy=True)
    block[changed] = values
    return block


def encode_file(
    parent: str | None,
    new: str,
    out: str,
    *,
    codec: str = "zlib",
    encoding: str = "xor",
    checksum: str | None = None,
) -> FileDelta:
    """Write the delta of ``new`` against ``parent`` (None: no parent file) to ``out``.

    ``encoding``: ``xor`` or ``overwrite`` for a file with the parent's safetensors layout (any
    other file is ``raw``); ``checksum``: the digest of each chunk's bytes (None: none)."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, not {encoding!r}")
    compress = CODECS[codec][0]
    _hasher(checksum)  # an unknown name fails before anything is written
    size = os.path.getsize(new)
    new_bytes = _map(new)
    if xor_compatible(parent, new):
        kind, parent_bytes = encoding, _map(parent)
        spans = _chunks_of(safetensors_layout(new), size)
    else:
        kind, parent_bytes = "raw", None
        spans = [("__file__", 0, size, 1)]
    if kind == "overwrite":
        spans = [(name, offset, length, 1) for name, offset, length, _ in spans]  # byte-level, not regrouped
    chunks, payload_path = [], out + ".payload"
    with open(payload_path, "wb") as payload:
        for name, offset, length, itemsize in spans:
            frames = []
            digest = _hasher(checksum)
            for start, count in _blocks(length):
                block = new_bytes[offset + start : offset + start + count]
                if digest is not None:
                    digest.update(np.asarray(block).tobytes())
                if kind == "overwrite":
                    frame = compress(_overwrite_frame(block, parent_bytes[offset + start : offset + start + count]))
                else:
                    if parent_bytes is not None:
                        block = np.bitwise_xor(block, parent_bytes[offset + start : offset + start + count])
                    frame = compress(_shuffle(np.asarray(block), itemsize).tobytes())
                payload.write(frame)
                frames.append(len(frame))
            chunks.append(Chunk(name, offset, length, itemsize, frames, digest.hexdigest() if digest else ""))
    result = FileDelta(kind=kind, codec=codec, size=size, chunks=chunks, checksum=checksum)
    header = msgspec.json.encode(result)
    try:
        with open(out, "wb") as f, open(payload_path, "rb") as payload:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            while data := payload.read(1 << 20):
                f.write(data)
    finally:
        os.remove(payload_path)
    return result


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
    if header.checksum is not None and header.checksum not in CHECKSUMS:
        raise DeltaError(f"{delta}: unknown checksum {header.checksum!r}")
    if header.checksum is not None and not checksum_available(header.checksum):
        raise DeltaError(
            f"{delta}: its chunks carry {header.checksum} digests, which need the "
            f"{CHECKSUMS[header.checksum][0]!r} package (not installed here)"
        )
    parent_bytes = None
    if header.kind in ENCODINGS:
        if parent is None or not os.path.exists(parent):
            raise DeltaError(f"{delta}: an {header.kind} delta needs the parent file, which is missing")
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
            digest = _hasher(header.checksum) if chunk.digest else None
            if len(blocks) != len(chunk.frames):
                raise DeltaError(f"{delta}: chunk {chunk.name} has {len(chunk.frames)} frames, expected {len(blocks)}")
            for (start, count), frame_size in zip(blocks, chunk.frames):
                frame = source.read(frame_size)
                try:
                    data = decompress(frame)
                except zlib.error as error:
                    raise DeltaError(f"{delta}: chunk {chunk.name} does not decompress ({error})") from None
                if len(frame) != frame_size:
                    raise DeltaError(f"{delta}: chunk {chunk.name} is truncated")
                at = chunk.offset + start
                if header.kind == "overwrite":
                    block = _apply_overwrite(data, parent_bytes[at : at + count], count, f"{delta}: chunk {chunk.name}")
                else:
                    if len(data) != count:
                        raise DeltaError(f"{delta}: chunk {chunk.name} is truncated")
                    block = _unshuffle(np.frombuffer(data, dtype=np.uint8), chunk.itemsize)
                    if parent_bytes is not None:
                        block = np.bitwise_xor(block, parent_bytes[at : at + count])
                rebuilt = block.tobytes()
                if digest is not None:
                    digest.update(rebuilt)
                target.write(rebuilt)
            if digest is not None and digest.hexdigest() != chunk.digest:
                raise DeltaError(
                    f"{delta}: rebuilt {chunk.name} does not match its {header.checksum} checksum "
                    "(the parent is not the bytes the delta was made against, or the delta is damaged)"
                )
            written += chunk.length
    if written != header.size:
        raise DeltaError(f"{delta}: chunks cover {written} bytes of {header.size}")
    return header


def encode_folder(
    parent_dir: str,
    new_dir: str,
    out_dir: str,
    *,
    codec: str = "zlib",
    encoding: str = "xor",
    checksum: str | None = None,
) -> dict[str, FileDelta]:
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
            encoding=encoding,
            checksum=checksum,
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
