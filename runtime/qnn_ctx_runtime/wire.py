"""Frames between the NPU worker and its client: raw tensor bytes behind a small binary header.

A frame is a 12-byte header (magic, kind, tensor count, meta length), a small UTF-8 JSON ``meta``
for control facts (output names, which shared segment, errors, ``facts()``), then one binary
header per tensor: name, dtype (numpy's ``dtype.str``), shape, size and where the bytes are.
Tensor bytes are never put in JSON or base64: a small tensor follows its header in the pipe, a
large one sits in a shared-memory :class:`Segment` that both processes map, so it is copied once
(by the writer, into the segment) and read in place. Values that are not plain arrays (object
arrays of strings, the sequences and maps of an ``ai.onnx.ml`` CPU tail) are pickled; both ends
are the same program started by the same user, so the pickle is trusted.

A segment is a file in ``/dev/shm`` (POSIX; unlinked by the client once the worker has mapped it,
so a killed pair leaks nothing) or a named mapping backed by the paging file (Windows).

Standard library and numpy only: the client side of the worker imports this module in Pythons
that have no onnxruntime (an x64 app on an ARM64 laptop).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import pickle
import secrets
import struct
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import IO, Any

import numpy as np

MAGIC = b"QCW1"
PROTOCOL = 1
ALIGN = 64  # byte alignment of tensors inside a segment
INLINE_LIMIT = 64 * 1024  # default: larger tensors go through shared memory
SEGMENT_PREFIX = "qnn-ctx-runtime-"  # + the creating client's pid

_FRAME = struct.Struct("<4sBxHI")  # magic, kind, tensor count, meta length
_TENSOR = struct.Struct("<HBBBBxxQQ")  # name len, dtype len, ndim, where, format, nbytes, offset


class Kind(IntEnum):
    READY = 1  # worker: loaded; meta = facts, inputs, outputs
    RUN = 2  # client: feeds; meta = output names, segments
    RESULT = 3  # worker: outputs
    ERROR = 4  # worker: an exception (type, message, tip)
    NEED = 5  # worker: the outputs need a response segment of meta["bytes"]
    SPACE = 6  # client: here it is, meta["response"]
    CLOSE = 7  # client: exit


class Where(IntEnum):
    INLINE = 0  # the bytes follow the tensor header in the stream
    SEGMENT = 1  # the bytes are at ``offset`` in the frame's segment


class Format(IntEnum):
    RAW = 0  # a numpy array's bytes, C order
    PICKLE = 1  # a pickled Python value


class ProtocolError(Exception):
    """The stream is not what this protocol writes (a stray print on the worker's stdout, a
    client and worker of different versions)."""


@dataclass
class Payload:
    """One value to send: a numeric array (sent raw) or anything else (pickled)."""

    name: str
    array: np.ndarray | None
    blob: bytes | None = None

    @classmethod
    def of(cls, name: str, value: Any) -> Payload:
        array = value if isinstance(value, np.ndarray) else None
        if array is None:
            try:
                array = np.asarray(value)
            except (TypeError, ValueError):  # ragged lists: let the other side's asarray say it
                array = None
        if array is None or array.dtype.hasobject:
            return cls(name, None, pickle.dumps(value, protocol=5))
        return cls(name, array)

    @property
    def nbytes(self) -> int:
        return self.array.nbytes if self.array is not None else len(self.blob or b"")


@dataclass
class TensorRef:
    """A received tensor header; ``data`` holds an inline value, a segment one is read later."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    where: Where
    format: Format
    nbytes: int
    offset: int
    data: Any = None

    def value_in(self, buffer: Any) -> Any:
        """The value, read in place from a segment's ``buffer`` (a view, not a copy)."""
        if self.where == Where.INLINE:
            return self.data
        if buffer is None:
            raise ProtocolError(f"tensor {self.name!r} is in a segment the frame does not name")
        if self.format == Format.PICKLE:
            return pickle.loads(memoryview(buffer)[self.offset : self.offset + self.nbytes])
        return np.ndarray(self.shape, np.dtype(self.dtype), buffer=buffer, offset=self.offset)


@dataclass
class Frame:
    kind: Kind
    meta: dict[str, Any]
    tensors: list[TensorRef]


def aligned(size: int) -> int:
    return (size + ALIGN - 1) // ALIGN * ALIGN


def placements(payloads: list[Payload], inline_limit: int) -> tuple[list[int | None], int]:
    """(offset in the segment or None for inline, per payload; segment bytes needed)."""
    offsets: list[int | None] = []
    end = 0
    for payload in payloads:
        if payload.nbytes <= inline_limit:
            offsets.append(None)
        else:
            offsets.append(end)
            end = aligned(end + payload.nbytes)
    return offsets, end


def write_frame(
    stream: IO[bytes],
    kind: Kind,
    meta: Mapping[str, Any] | None = None,
    payloads: list[Payload] | None = None,
    offsets: list[int | None] | None = None,
    segment: Any = None,
) -> None:
    """Copy segment payloads into ``segment`` (their one copy), then write the frame at once."""
    payloads = payloads or []
    offsets = offsets if offsets is not None else [None] * len(payloads)
    meta_bytes = json.dumps(meta, separators=(",", ":"), default=str).encode() if meta else b""
    out = bytearray(_FRAME.pack(MAGIC, kind, len(payloads), len(meta_bytes)))
    out += meta_bytes
    for payload, offset in zip(payloads, offsets, strict=True):
        name = payload.name.encode()
        array = payload.array
        if array is not None:
            dtype, shape, fmt = array.dtype.str.encode(), array.shape, Format.RAW
        else:
            dtype, shape, fmt = b"", (), Format.PICKLE
        where = Where.INLINE if offset is None else Where.SEGMENT
        out += _TENSOR.pack(
            len(name), len(dtype), len(shape), where, fmt, payload.nbytes, offset or 0
        )
        out += struct.pack(f"<{len(shape)}q", *shape)
        out += name + dtype
        if offset is None:
            out += payload.blob if array is None else _bytes_of(array)
        elif array is None:
            segment[offset : offset + payload.nbytes] = payload.blob
        elif array.nbytes:
            target = np.ndarray(array.shape, array.dtype, buffer=segment, offset=offset)
            np.copyto(target, array, casting="no")
    view = memoryview(out)
    while view:
        written = stream.write(view)
        if written is None:  # a non-blocking stream: not what this protocol uses
            raise ProtocolError("the frame stream is non-blocking")
        view = view[written:]


def _bytes_of(array: np.ndarray) -> memoryview:
    flat = np.ascontiguousarray(array).reshape(-1)
    return memoryview(flat.view(np.uint8)) if flat.size else memoryview(b"")


def read_frame(stream: IO[bytes]) -> Frame | None:
    """The next frame, inline tensors read into fresh arrays; None at a clean end of stream."""
    head = stream.read(_FRAME.size)
    if not head:
        return None
    magic, kind, count, meta_len = _FRAME.unpack(_read_rest(stream, head, _FRAME.size))
    if magic != MAGIC:
        raise ProtocolError(f"bad frame start {magic!r} (expected {MAGIC!r})")
    try:
        kind = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    meta = json.loads(_read_exact(stream, meta_len)) if meta_len else {}
    tensors = []
    for _ in range(count):
        name_len, dtype_len, ndim, where, fmt, nbytes, offset = _TENSOR.unpack(
            _read_exact(stream, _TENSOR.size)
        )
        shape = struct.unpack(f"<{ndim}q", _read_exact(stream, 8 * ndim))
        name = _read_exact(stream, name_len).decode()
        dtype = _read_exact(stream, dtype_len).decode()
        ref = TensorRef(name, dtype, shape, Where(where), Format(fmt), nbytes, offset)
        if ref.where == Where.INLINE:
            if ref.format == Format.PICKLE:
                ref.data = pickle.loads(_read_exact(stream, nbytes))
            else:
                ref.data = np.empty(shape, np.dtype(dtype))
                if nbytes:
                    _read_into(stream, memoryview(ref.data.reshape(-1).view(np.uint8)))
        tensors.append(ref)
    return Frame(kind, meta, tensors)


def _read_rest(stream: IO[bytes], head: bytes, size: int) -> bytes:
    return head if len(head) == size else head + _read_exact(stream, size - len(head))


def _read_exact(stream: IO[bytes], size: int) -> bytes:
    data = stream.read(size) if size else b""
    while len(data) < size:
        more = stream.read(size - len(data))
        if not more:
            raise EOFError(f"the stream ended inside a frame ({len(data)} of {size} bytes)")
        data += more
    return data


def _read_into(stream: IO[bytes], view: memoryview) -> None:
    while view:
        got = stream.readinto(view)  # type: ignore[attr-defined]
        if not got:
            raise EOFError("the stream ended inside a tensor")
        view = view[got:]


class Segment:
    """A block of shared memory both processes map; ``name`` is what the other side attaches by."""

    def __init__(self, name: str, size: int, buffer: mmap.mmap, path: str | None) -> None:
        self.name = name
        self.size = size
        self.buffer = buffer
        self._path = path  # POSIX: the file to unlink once the other side has mapped it

    @classmethod
    def create(cls, size: int) -> Segment:
        size = max(aligned(size), ALIGN)
        if sys.platform == "win32":
            name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
            return cls(name, size, mmap.mmap(-1, size, tagname=name), None)
        fd, path = tempfile.mkstemp(prefix=f"{SEGMENT_PREFIX}{os.getpid()}-", dir=_shm_folder())
        try:
            os.ftruncate(fd, size)
            buffer = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(path, size, buffer, path)

    @classmethod
    def attach(cls, name: str, size: int) -> Segment:
        if sys.platform == "win32":
            return cls(name, size, mmap.mmap(-1, size, tagname=name), None)
        fd = os.open(name, os.O_RDWR)
        try:
            return cls(name, size, mmap.mmap(fd, size), None)
        finally:
            os.close(fd)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size}

    def unlink(self) -> None:
        """Remove the name (POSIX); the memory lives on while either side maps it."""
        if self._path is not None:
            path, self._path = self._path, None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def close(self) -> None:
        """Unmap, unless arrays still view the memory (then it goes with the last of them)."""
        self.unlink()
        with contextlib.suppress(BufferError):
            self.buffer.close()


def _shm_folder() -> str | None:
    """RAM-backed /dev/shm where there is one (Linux), else the temp folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def option_args(options: Mapping[str, Any]) -> list[str]:
    """``load()`` keyword arguments as ``serve`` flags: ``target="x"`` -> ``--target=x``,
    ``allow_cpu_fallback=True`` -> ``--allow-cpu-fallback`` (False -> ``--no-...``), None left out."""
    args = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + name.replace("_", "-"))
        else:
            args.append(f"{flag}={os.fspath(value) if isinstance(value, os.PathLike) else value}")
    return args
