"""Read a tar shard as a stream of ``(name, bytes)`` members, and notice when it ends early.

Python's ``tarfile`` reads a cut or damaged header as the end of the archive: a
shard cut in the middle of a header, at a member boundary, or inside the gzip
trailer simply yields fewer members, with no error. :func:`tar_members` reads the
same archives but checks how the stream ended:

* the header after the last member must be a full block of zeros (the
  end-of-archive marker); a short block, no block at all, or a block that fails
  its checksum raise :class:`TruncatedShardError`;
* a member whose data runs past the end raises it too;
* compressed shards (gzip, bzip2, xz, detected from their first bytes) are
  decompressed by the standard library readers, which check the stream's end
  marker and checksum (``EOFError`` / ``BadGzipFile`` for a cut or damaged file);
* anything but zeros after the end-of-archive marker (two tars concatenated,
  whose second half ``tarfile`` would skip) raises :class:`TrailingDataError`.

Members are read one at a time and never all at once: ``select`` names the members
whose data is wanted (the others are streamed past, their data never held in memory,
and yielded as ``(name, None)``), and a member whose header declares more than
``max_member_bytes`` is not read either: it is yielded as ``(name, MemberTooLargeError)``,
so a gzip bomb (a small shard holding one huge member of zeros) costs time, not memory.
Links (symbolic or hard) and other members that are not regular files (devices,
FIFOs) are yielded as ``(name, UnsupportedMemberError)``; directories are skipped.

>>> import io, tarfile
>>> buf = io.BytesIO()
>>> with tarfile.open(fileobj=buf, mode="w") as tf:
...     info = tarfile.TarInfo("0001.txt"); info.size = 2
...     tf.addfile(info, io.BytesIO(b"hi"))
>>> list(tar_members(io.BytesIO(buf.getvalue())))
[('0001.txt', b'hi')]
>>> list(tar_members(io.BytesIO(buf.getvalue()[:1000])))
Traceback (most recent call last):
...
padless.loaders.tarstream.TruncatedShardError: the shard ends before byte 1024, inside the data of the member before it; the shard is cut short
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import tarfile
from typing import Any, BinaryIO, Callable, Iterator

BLOCK = tarfile.BLOCKSIZE
_MAGIC: tuple[tuple[bytes, Callable[[BinaryIO], BinaryIO]], ...] = (
    (b"\x1f\x8b", lambda f: gzip.GzipFile(fileobj=f, mode="rb")),  # type: ignore[arg-type,return-value]
    (b"BZh", lambda f: bz2.BZ2File(f, mode="rb")),  # type: ignore[return-value]
    (b"\xfd7zXZ\x00", lambda f: lzma.LZMAFile(f, mode="rb")),  # type: ignore[return-value]
)


class TruncatedShardError(tarfile.ReadError):
    """A shard that ends before its end-of-archive marker: cut short, or a damaged header.

    ``offset`` is the byte (in the uncompressed tar) where reading stopped, and
    ``member`` the member whose data was cut, if any.
    """

    def __init__(self, message: str, offset: int | None = None, member: str | None = None) -> None:
        super().__init__(message)
        self.offset = offset
        self.member = member


class TrailingDataError(tarfile.ReadError):
    """Data after the end-of-archive marker (every member before it was read in full)."""


DEFAULT_MAX_MEMBER_BYTES = 1 << 30  # 1 GiB: a member declaring more is refused unread


class MemberError(ValueError):
    """A tar member that is not read: ``member`` is its name in the shard."""

    def __init__(self, message: str, member: str) -> None:
        super().__init__(message)
        self.member = member


class MemberTooLargeError(MemberError):
    """A member whose header declares more bytes than the reader's ``max_member_bytes`` (not read)."""


class UnsupportedMemberError(MemberError):
    """A member that is a symbolic or hard link, a device or a FIFO, not a regular file (not followed)."""


_KINDS = {
    tarfile.SYMTYPE: "a symbolic link",
    tarfile.LNKTYPE: "a hard link",
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a FIFO",
}


class _Prefixed(io.RawIOBase):
    """A read-only stream: ``head`` (bytes already read from ``rest``), then ``rest``."""

    def __init__(self, head: bytes, rest: BinaryIO) -> None:
        self._head = head
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self._head:
            n = min(len(b), len(self._head))
            b[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        data = self._rest.read(len(b))
        b[: len(data)] = data
        return len(data)


def decompressed(stream: BinaryIO) -> BinaryIO:
    """``stream`` itself, or a decompressing reader when it starts with a gzip, bzip2 or xz header."""
    seekable = getattr(stream, "seekable", lambda: False)()
    start = stream.tell() if seekable else 0
    head = stream.read(6)
    if seekable:
        stream.seek(start)  # a local file: read on from where it started, with no extra layer
        raw: BinaryIO = stream
    else:
        raw = io.BufferedReader(_Prefixed(head, stream))  # type: ignore[assignment]
    for magic, reader in _MAGIC:
        if head.startswith(magic):
            return reader(raw)
    return raw


class _LastRead:
    """Wraps tarfile's stream to remember the last block read (the header that ended the archive)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.last = b"\0" * BLOCK  # the first header was read before this wrapper: a failed one raised

    def read(self, size: int = -1) -> bytes:
        data = self.inner.read(size)
        self.last = data
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def tar_members(
    stream: BinaryIO,
    *,
    select: Callable[[str], bool] | None = None,
    max_member_bytes: int | None = DEFAULT_MAX_MEMBER_BYTES,
) -> Iterator[tuple[str, bytes | None | MemberError]]:
    """``(name, data)`` of every member but directories in a (possibly compressed) tar stream, in order.

    ``data`` is the member's bytes; ``None`` for a member ``select(name)`` rejects
    (its data is streamed past, never held); a :class:`MemberTooLargeError` for a
    member whose header declares more than ``max_member_bytes`` (``None``: no limit;
    not read either); an :class:`UnsupportedMemberError` for a link, a device or a FIFO.

    Raises :class:`TruncatedShardError` (after yielding every complete member) when
    the archive ends early, :class:`TrailingDataError` for data after its end,
    ``tarfile.ReadError`` for other damage; errors of the
    decompressor (``EOFError``, ``gzip.BadGzipFile``, ``zlib.error``) pass through.
    """
    try:
        tf = tarfile.open(fileobj=decompressed(stream), mode="r|")
    except tarfile.ReadError as e:
        raise TruncatedShardError(f"the first header cannot be read ({e}): the shard is empty, cut short or not a tar file", 0) from e
    rec = _LastRead(tf.fileobj)
    tf.fileobj = rec
    while True:
        try:
            m = tf.next()
        except tarfile.ReadError as e:
            if str(e) == "unexpected end of data":  # tarfile could not skip to the next header
                raise TruncatedShardError(
                    f"the shard ends before byte {tf.offset}, inside the data of the member before it; the shard is cut short",
                    tf.offset,
                ) from e
            raise TruncatedShardError(f"the shard cannot be read past byte {tf.offset} ({e}); it is damaged or cut short", tf.offset) from e
        if m is None:
            break
        tf.members.clear()  # stream mode would otherwise keep every header of the shard
        if m.isdir():
            continue
        if not m.isfile():
            kind = _KINDS.get(m.type, f"a member of tar type {m.type!r}")
            target = f" to {m.linkname!r}" if m.issym() or m.islnk() else ""
            yield m.name, UnsupportedMemberError(
                f"member {m.name!r} is {kind}{target}, not a regular file; padless does not follow it "
                "(write the file itself into the shard)",
                m.name,
            )
            continue
        if select is not None and not select(m.name):
            yield m.name, None  # tarfile streams past its data when the next header is read
            continue
        if max_member_bytes is not None and m.size > max_member_bytes:
            yield m.name, MemberTooLargeError(
                f"member {m.name!r} declares {m.size} bytes, over max_member_bytes={max_member_bytes}; "
                "it was not read (pass a larger max_member_bytes=, or None for no limit)",
                m.name,
            )
            continue
        try:
            data = tf.extractfile(m).read()  # type: ignore[union-attr]
        except tarfile.ReadError:
            data = b""  # tarfile's "unexpected end of data"
        if len(data) != m.size:
            raise TruncatedShardError(
                f"member {m.name!r} is truncated: its {m.size} bytes run past the end of the shard", m.offset_data, m.name
            )
        yield m.name, data
    check_end(rec, tf.offset)


def check_end(rec: _LastRead, offset: int) -> None:
    """Raise unless the block at ``offset`` is the end-of-archive marker and only zeros follow."""
    last = rec.last
    if len(last) == 0:
        raise TruncatedShardError(
            f"the shard ends at byte {offset}, after a complete member but without the end-of-archive marker; "
            "the shard is cut short",
            offset,
        )
    if len(last) < BLOCK:
        raise TruncatedShardError(
            f"the shard ends at byte {offset + len(last)} with a partial header of {len(last)} bytes "
            f"(a tar block is {BLOCK}); the shard is cut short",
            offset,
        )
    if last.count(0) != BLOCK:
        raise TruncatedShardError(f"the header at byte {offset} fails its checksum; the shard is damaged or cut short", offset)
    pos = offset + BLOCK
    while True:
        chunk = rec.read(1 << 16)  # also lets a compressed stream check its end marker and checksum
        if not chunk:
            return
        if chunk.count(0) != len(chunk):
            at = pos + next(i for i, b in enumerate(chunk) if b)
            raise TrailingDataError(
                f"data after the end-of-archive marker at byte {at} (two tar files concatenated?); "
                "those members would be skipped: write one archive per shard"
            )
        pos += len(chunk)
