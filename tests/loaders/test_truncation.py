"""Truncated and damaged shards: no sample is lost without the handler hearing of it (issue 13, item 1)."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import tarfile
import warnings

import pytest

from padless.loaders import SampleError, SkipAndWarn, WebDatasetReader, raise_error
from padless.loaders.tarstream import TruncatedShardError, tar_members

# Three samples; sample 1's text sits under a long directory name (a pax header in front of it).
LONG = "d" * 120 + "/0001"
SAMPLES = [("0000", 700), (LONG, 30), ("0002", 1100)]
KEYS = [k for k, _ in SAMPLES]


def shard_bytes(fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for i, (key, n) in enumerate(SAMPLES):
            for ext, data in (("txt", bytes([97 + i]) * n), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def read(path: str) -> tuple[list[dict], list[tuple[str | None, BaseException]]]:
    calls: list[tuple[str | None, BaseException]] = []

    def remember(exc: BaseException, *, shard: str, key: str | None) -> None:
        assert shard == path
        calls.append((key, exc))

    return list(WebDatasetReader(path, handler=remember)), calls


@pytest.mark.parametrize("kind", ["tar", "tar.gz"])
def test_every_cut_yields_all_samples_or_reaches_the_handler(tmp_path, kind) -> None:
    """The sweep: cut the shard at every Nth byte; no cut may lose a sample silently."""
    raw = shard_bytes()
    blob, step = (raw, 64) if kind == "tar" else (gzip.compress(raw, mtime=0), 3)
    path = str(tmp_path / f"s.{kind}")
    complete = reported = 0
    for cut in [*range(0, len(blob), step), len(blob)]:
        with open(path, "wb") as f:
            f.write(blob[:cut])
        got, calls = read(path)
        keys = [s["__key__"] for s in got]
        assert keys == KEYS[: len(keys)], f"cut at {cut}: samples out of order or invented"
        for s in got:
            i = KEYS.index(s["__key__"])
            assert s["txt"] == chr(97 + i) * SAMPLES[i][1] and s["cls"] == i, f"cut at {cut}: a sample's data changed"
        if keys == KEYS and not calls:
            complete += 1
            continue
        assert len(calls) == 1, f"cut at {cut} of {len(blob)}: {len(keys)} of 3 samples and {len(calls)} handler calls"
        reported += 1
        err = calls[0][1]
        assert isinstance(err, TruncatedShardError)
        assert (f"the last complete sample is {keys[-1]!r}" if keys else "no sample was complete") in str(err)
    assert complete >= 1 and reported >= 10  # both outcomes are exercised


def test_the_audit_case_a_tar_cut_between_members(tmp_path) -> None:
    """Cut at the end of a member's data: tarfile sees no next header and ends quietly."""
    raw = shard_bytes(tarfile.USTAR_FORMAT)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        cut = next(m for m in tf.getmembers() if m.name == "0000.cls").offset  # sample 0 ends here
    path = str(tmp_path / "cut.tar")
    with open(path, "wb") as f:
        f.write(raw[:cut])
    handler = SkipAndWarn()
    with pytest.warns(RuntimeWarning, match=r"cut\.tar', sample key '0000': TruncatedShardError: the shard ends at byte \d+, after a complete member but without the end-of-archive marker; the shard is cut short; no sample was complete"):
        assert list(WebDatasetReader(path, handler=handler)) == []
    assert handler.counts == {path: 1}


def test_short_final_block_names_the_last_good_key(tmp_path) -> None:
    raw = shard_bytes(tarfile.USTAR_FORMAT)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        start = next(m for m in tf.getmembers() if m.name == "0002.txt").offset
    path = str(tmp_path / "short.tar")
    with open(path, "wb") as f:
        f.write(raw[: start + 100])
    with pytest.raises(SampleError, match=r"sample key '" + LONG + r"': TruncatedShardError: the shard ends at byte \d+ with a partial header of 100 bytes .*; the last complete sample is '0000', the rest of the shard is lost") as e:
        list(WebDatasetReader(path, handler=raise_error))
    assert e.value.key == LONG


def test_a_header_that_fails_its_checksum(tmp_path) -> None:
    raw = bytearray(shard_bytes(tarfile.USTAR_FORMAT))
    with tarfile.open(fileobj=io.BytesIO(bytes(raw))) as tf:
        start = next(m for m in tf.getmembers() if m.name == "0002.txt").offset
    raw[start + 10] ^= 0x55  # inside the name field
    path = str(tmp_path / "bad.tar")
    with open(path, "wb") as f:
        f.write(bytes(raw))
    got, calls = read(path)
    assert [s["__key__"] for s in got] == ["0000"]
    assert len(calls) == 1 and "fails its checksum" in str(calls[0][1]) and calls[0][0] == LONG


def test_member_data_running_past_the_end(tmp_path) -> None:
    raw = shard_bytes(tarfile.USTAR_FORMAT)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        m = next(m for m in tf.getmembers() if m.name == "0002.txt")
    path = str(tmp_path / "data.tar")
    with open(path, "wb") as f:
        f.write(raw[: m.offset_data + 600])
    got, calls = read(path)
    assert [s["__key__"] for s in got] == ["0000", LONG]
    assert calls[0][0] == "0002" and "member '0002.txt' is truncated: its 1100 bytes run past the end of the shard" in str(calls[0][1])


def test_gzip_without_its_trailer(tmp_path) -> None:
    """The tar inside is complete; only the gzip CRC and size are missing."""
    blob = gzip.compress(shard_bytes(), mtime=0)
    path = str(tmp_path / "s.tar.gz")
    with open(path, "wb") as f:
        f.write(blob[:-4])
    got, calls = read(path)
    assert len(calls) == 1 and isinstance(calls[0][1], TruncatedShardError)
    assert "EOFError: Compressed file ended before the end-of-stream marker was reached" in str(calls[0][1])


def test_concatenated_tars_are_reported_not_skipped(tmp_path) -> None:
    raw = shard_bytes()
    path = str(tmp_path / "two.tar")
    with open(path, "wb") as f:
        f.write(raw + raw)
    got, calls = read(path)
    assert [s["__key__"] for s in got] == KEYS
    assert len(calls) == 1 and "data after the end-of-archive marker" in str(calls[0][1])


def test_complete_shards_read_without_a_word(tmp_path) -> None:
    raw = shard_bytes()
    for name, blob in (("a.tar", raw), ("a.tar.gz", gzip.compress(raw)), ("a.tar.bz2", bz2.compress(raw)), ("a.tar.xz", lzma.compress(raw))):
        path = str(tmp_path / name)
        with open(path, "wb") as f:
            f.write(blob)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert [s["__key__"] for s in WebDatasetReader(path)] == KEYS


def test_cut_bzip2_and_xz_shards_reach_the_handler(tmp_path) -> None:
    for name, blob in (("c.tar.bz2", bz2.compress(shard_bytes())), ("c.tar.xz", lzma.compress(shard_bytes()))):
        path = str(tmp_path / name)
        with open(path, "wb") as f:
            f.write(blob[: len(blob) - 10])
        _, calls = read(path)
        assert len(calls) == 1 and "EOFError" in str(calls[0][1])


def test_tar_members_on_a_plain_stream() -> None:
    raw = shard_bytes()
    assert [n for n, _ in tar_members(io.BytesIO(raw))][:2] == ["0000.txt", "0000.cls"]
    with pytest.raises(TruncatedShardError, match="partial header of 12 bytes"):
        list(tar_members(io.BytesIO(raw[: 512 + 1024 + 12])))


class _Unseekable(io.RawIOBase):
    """A pipe-like stream (as from ``pipe:curl ...``): no seek, no tell."""

    def __init__(self, data: bytes) -> None:
        self._src = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # noqa: ANN001
        data = self._src.read(len(b))
        b[: len(data)] = data
        return len(data)


def test_unseekable_streams_plain_and_compressed() -> None:
    raw = shard_bytes()
    for blob in (raw, gzip.compress(raw)):
        assert [n for n, _ in tar_members(_Unseekable(blob))][-1] == "0002.cls"
        with pytest.raises((TruncatedShardError, EOFError)):
            list(tar_members(_Unseekable(blob[: 3000 if blob is raw else len(blob) // 2])))
