"""Reliability, third round (issue 25): gzip member bombs, images that lie about their format,
FIFOs named like images, duplicate and linked tar members, tuple field specs.

The 1 GiB gzip bomb runs only with ``PADLESS_RELIABILITY_LARGE=1`` (it takes a few seconds);
the small bombs below always run.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import signal
import stat
import subprocess
import sys
import tarfile
import textwrap
import tracemalloc
import warnings

import pytest

from padless.loaders import (
    DuplicateMemberError,
    ImageFolder,
    MemberTooLargeError,
    NotARegularFileError,
    SampleError,
    SkipAndWarn,
    UnsupportedImageFormatError,
    UnsupportedMemberError,
    WebDatasetReader,
    decode_image,
    raise_error,
)
from padless.loaders.synthetic import image_bytes

pytest.importorskip("PIL.Image")

LARGE = os.environ.get("PADLESS_RELIABILITY_LARGE") == "1"
EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nnewpath 0 0 moveto 10 10 lineto stroke\nshowpage\n%%EOF\n"


class _Zeros(io.RawIOBase):
    """``n`` zero bytes, read in chunks (the bomb is never held in memory while it is written)."""

    def __init__(self, n: int) -> None:
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[no-untyped-def]
        k = min(len(b), self.left)
        b[:k] = bytes(k)
        self.left -= k
        return k


def write_bomb(path: str, zeros: int) -> None:
    """A .tar.gz: sample 0000 with a ``zeros``-byte ``0000.bin`` and a ``0000.cls``; sample 0001 with a ``cls``."""
    with gzip.open(path, "wb", compresslevel=6) as gz, tarfile.open(fileobj=gz, mode="w|") as tf:
        info = tarfile.TarInfo("0000.bin")
        info.size = zeros
        tf.addfile(info, io.BufferedReader(_Zeros(zeros), 1 << 20))
        for name, data in (("0000.cls", b"7"), ("0001.cls", b"8")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def write_tar(path: str, members: list) -> str:
    """``members``: ``(name, bytes)`` for files, ``(name, "sym"|"hard", target)`` for links."""
    with tarfile.open(path, "w") as tf:
        for m in members:
            info = tarfile.TarInfo(m[0])
            if len(m) == 3:
                info.type = tarfile.SYMTYPE if m[1] == "sym" else tarfile.LNKTYPE
                info.linkname = m[2]
                tf.addfile(info)
            else:
                info.size = len(m[1])
                tf.addfile(info, io.BytesIO(m[1]))
    return path


def recorded(path: str, **kw) -> tuple[list[dict], list[tuple[str | None, BaseException]]]:
    calls: list[tuple[str | None, BaseException]] = []

    def remember(exc: BaseException, *, shard: str, key: str | None) -> None:
        calls.append((key, exc))

    return list(WebDatasetReader(path, shuffle_shards=False, handler=remember, **kw)), calls


# ---------------------------------------------------------------------------------------- 1. member bombs


def test_a_member_no_field_uses_is_streamed_past_unread(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "bomb.tar.gz")
    write_bomb(path, 32 << 20)
    assert os.path.getsize(path) < 1 << 20
    opened: list[str] = []
    extract = tarfile.TarFile.extractfile
    monkeypatch.setattr(tarfile.TarFile, "extractfile", lambda self, m: (opened.append(m.name), extract(self, m))[1])
    tracemalloc.start()
    try:
        got, calls = recorded(path, fields={"label": "cls"})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(s["__key__"], s["label"]) for s in got] == [("0000", 7), ("0001", 8)] and calls == []
    assert opened == ["0000.cls", "0001.cls"]  # the bin member's data was never opened
    assert peak < 8 << 20, f"reading a shard with a 32 MiB member no field uses peaked at {peak / 2**20:.1f} MiB"


def test_a_member_over_the_byte_limit_reaches_the_handler_unread(tmp_path) -> None:
    path = str(tmp_path / "bomb.tar.gz")
    write_bomb(path, 8 << 20)
    tracemalloc.start()
    try:
        got, calls = recorded(path, max_member_bytes=4 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [s["__key__"] for s in got] == ["0001"]
    assert len(calls) == 1 and calls[0][0] == "0000" and isinstance(calls[0][1], MemberTooLargeError)
    assert peak < 6 << 20
    with pytest.raises(
        SampleError,
        match=r"sample key '0000': MemberTooLargeError: member '0000.bin' declares 8388608 bytes, over max_member_bytes=4194304; it was not read",
    ):
        list(WebDatasetReader(path, max_member_bytes=4 << 20, handler=raise_error))
    got, calls = recorded(path)  # the default limit (1 GiB) reads it
    assert len(got) == 2 and len(got[0]["bin"]) == 8 << 20 and calls == []


def test_max_member_bytes_is_checked() -> None:
    with pytest.raises(ValueError, match=r"max_member_bytes must be an int >= 0 or None \(no limit\), got -1"):
        WebDatasetReader("x.tar", max_member_bytes=-1)


_CHILD = """
import resource, sys
from padless.loaders import WebDatasetReader
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
calls = []
got = list(WebDatasetReader(sys.argv[1], fields={"label": "cls"}, shuffle_shards=False,
                            handler=lambda e, shard, key: calls.append(key)))
assert [s["label"] for s in got] == [7, 8] and calls == [], (got, calls)
got = list(WebDatasetReader(sys.argv[1], shuffle_shards=False, handler=lambda e, shard, key: calls.append((key, type(e).__name__))))
assert [s["__key__"] for s in got] == ["0001"] and calls == [("0000", "MemberTooLargeError")], (got, calls)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"before_kib": before, "after_kib": after}))
"""


@pytest.mark.skipif(not LARGE, reason="set PADLESS_RELIABILITY_LARGE=1 for the 1 GiB gzip bomb")
def test_a_one_gib_gzip_bomb_costs_no_memory(tmp_path) -> None:
    path = str(tmp_path / "bomb.tar.gz")
    write_bomb(path, (1 << 30) + 4096)  # just over the default 1 GiB member limit
    out = subprocess.run(
        [sys.executable, "-c", "import json\n" + textwrap.dedent(_CHILD), path], capture_output=True, text=True, check=True
    )
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    grown = (rss["after_kib"] - rss["before_kib"]) / 1024
    print(f"\nbomb {os.path.getsize(path) / 2**20:.2f} MiB compressed; peak RSS {rss['after_kib'] / 1024:.0f} MiB "
          f"(after imports {rss['before_kib'] / 1024:.0f} MiB, grown {grown:.1f} MiB)")
    assert grown < 64, f"reading a 1 GiB gzip bomb grew the peak RSS by {grown:.0f} MiB"


# ---------------------------------------------------------------------------------------- 2. lying formats


@pytest.fixture
def fake_gs(tmp_path, monkeypatch):
    """A ``gs`` first on PATH that records being run; Pillow's cached Ghostscript lookup is reset."""
    from PIL import EpsImagePlugin

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "gs-ran"
    gs = bin_dir / "gs"
    gs.write_text(f"#!/bin/sh\necho \"$@\" >> {record}\nexit 1\n")
    gs.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None)
    return record


def test_eps_behind_a_jpg_name_never_starts_ghostscript(tmp_path, fake_gs) -> None:
    msg = r"the image data is in the EPS format by its first bytes, which padless does not open \(it opens JPEG, PNG, .*\); nothing was decoded or run"
    with pytest.raises(UnsupportedImageFormatError, match="decode_image: " + msg) as e:
        decode_image(EPS)
    assert e.value.format == "EPS"
    shard = write_tar(str(tmp_path / "s.tar"), [("0000.jpg", EPS), ("0000.cls", b"1"), ("0001.jpg", image_bytes(4, 5, "jpg")), ("0001.cls", b"2")])
    got, calls = recorded(shard, fields={"image": "jpg", "label": "cls"})
    assert [s["__key__"] for s in got] == ["0001"]
    assert len(calls) == 1 and calls[0][0] == "0000" and isinstance(calls[0][1], UnsupportedImageFormatError)
    root = tmp_path / "folder" / "a"
    root.mkdir(parents=True)
    (root / "x.jpg").write_bytes(EPS)
    (root / "y.png").write_bytes(image_bytes(4, 5, "png"))
    handler: list[BaseException] = []
    ds = ImageFolder(str(tmp_path / "folder"), handler=lambda exc, shard, key: handler.append(exc))
    assert len(ds) == 1 and len(handler) == 1 and isinstance(handler[0], UnsupportedImageFormatError)
    assert "image_header_size: the image data is in the EPS format" in str(handler[0])
    assert not fake_gs.exists(), f"Ghostscript was started: {fake_gs.read_text()!r}"


# ---------------------------------------------------------------------------------------- 3. FIFOs


class _Hung(BaseException):
    """Raised by the alarm: a BaseException, so no reader's ``except Exception`` can swallow it."""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_a_fifo_named_like_an_image_goes_to_the_handler_without_blocking(tmp_path) -> None:
    root = tmp_path / "folder" / "a"
    root.mkdir(parents=True)
    (root / "ok.png").write_bytes(image_bytes(4, 5, "png"))
    os.mkfifo(root / "x.png")

    def hung(*_):  # type: ignore[no-untyped-def]
        raise _Hung("ImageFolder blocked on the FIFO")

    old = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, 5.0)
    try:
        handler = SkipAndWarn()
        with pytest.warns(RuntimeWarning, match=r"sample key 'a/x.png': NotARegularFileError: ImageFolder: .*x\.png' is a FIFO \(named pipe\), not a regular file"):
            ds = ImageFolder(str(tmp_path / "folder"), handler=handler)
        with pytest.raises(NotARegularFileError, match=r"decode_image: .*x\.png' is a FIFO \(named pipe\), not a regular file; it was not opened"):
            decode_image(str(root / "x.png"))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert len(ds) == 1 and ds.paths[0].endswith("ok.png") and handler.total == 1
    assert stat.S_ISFIFO(os.stat(root / "x.png").st_mode)
    assert issubclass(NotARegularFileError, OSError)


# ---------------------------------------------------------------------------------------- 6. duplicates and links


PNG = None


def _png() -> bytes:
    global PNG
    if PNG is None:
        PNG = image_bytes(4, 5, "png")
    return PNG


CASES = {
    "same name twice": (
        [("0000.png", "P"), ("0000.cls", b"1"), ("0000.png", "P"), ("0001.png", "P"), ("0001.cls", b"2")],
        "0000",
        r"member '0000.png': sample '0000' already has a 'png' member",
        DuplicateMemberError,
    ),
    "names differing in case": (
        [("0000.PNG", "P"), ("0000.png", "P"), ("0000.cls", b"1"), ("0001.png", "P"), ("0001.cls", b"2")],
        "0000",
        r"member '0000.png': sample '0000' already has a 'png' member \(fields are matched in lower case\)",
        DuplicateMemberError,
    ),
    "a key that reappears": (
        [("0000.png", "P"), ("0000.cls", b"1"), ("0001.png", "P"), ("0001.cls", b"2"), ("0000.txt", b"late")],
        "0000",
        r"sample key '0000' appears again at member '0000.txt', after other keys",
        DuplicateMemberError,
    ),
    "a symlink": (
        [("0000.png", "sym", "/etc/passwd"), ("0000.cls", b"1"), ("0001.png", "P"), ("0001.cls", b"2")],
        "0000",
        r"member '0000.png' is a symbolic link to '/etc/passwd', not a regular file",
        UnsupportedMemberError,
    ),
    "a hardlink": (
        [("0001.png", "P"), ("0001.cls", b"2"), ("0000.png", "hard", "0001.png"), ("0000.cls", b"1")],
        "0000",
        r"member '0000.png' is a hard link to '0001.png', not a regular file",
        UnsupportedMemberError,
    ),
}


@pytest.mark.parametrize("fields", [None, {"image": "png", "label": "cls"}, {"label": "cls"}], ids=["all", "png+cls", "cls-only"])
@pytest.mark.parametrize("case", list(CASES))
def test_duplicate_and_linked_members_reach_the_handler(tmp_path, case, fields) -> None:
    members, key, message, kind = CASES[case]
    members = [(m[0], _png()) if m[1] == "P" else m for m in members]
    shard = write_tar(str(tmp_path / "s.tar"), members)
    handler = SkipAndWarn()
    with pytest.warns(RuntimeWarning, match=rf"sample key '{key}': {kind.__name__}: {message}"):
        got = list(WebDatasetReader(shard, fields=fields, shuffle_shards=False, handler=handler))
    assert handler.total == 1
    assert [s["__key__"] for s in got] == (["0001"] if case != "a key that reappears" else ["0000", "0001"])
    label = "label" if fields else "cls"
    assert [s[label] for s in got] == ([2] if case != "a key that reappears" else [1, 2])


def test_a_link_without_a_sample_key_reaches_the_handler(tmp_path) -> None:
    shard = write_tar(str(tmp_path / "s.tar"), [("README", "sym", "x"), ("0000.cls", b"1")])
    got, calls = recorded(shard)
    assert [s["cls"] for s in got] == [1]
    assert len(calls) == 1 and calls[0][0] == "README" and isinstance(calls[0][1], UnsupportedMemberError)


# ---------------------------------------------------------------------------------------- 9. field specs


def test_fields_take_a_tuple_or_list_of_extensions(tmp_path) -> None:
    shard = write_tar(str(tmp_path / "s.tar"), [("0000.png", _png()), ("0000.cls", b"3")])
    for spec in (("png",), ["jpg", "png"], "jpg;png", ("PNG",)):
        got, calls = recorded(shard, fields={"image": spec, "label": ("cls",)})
        assert calls == [] and [tuple(s["image"].shape) for s in got] == [(3, 4, 5)] and got[0]["label"] == 3
    with pytest.raises(TypeError, match=r"WebDatasetReader: fields\['image'\] must be extensions as a string 'jpg;png' or a tuple/list of strings \('jpg', 'png'\), got 3"):
        WebDatasetReader(shard, fields={"image": 3})
    with pytest.raises(ValueError, match=r"WebDatasetReader: fields\['image'\] has an empty extension: \('png', ''\)"):
        WebDatasetReader(shard, fields={"image": ("png", "")})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(WebDatasetReader(shard, fields={"image": ("png",)}, shuffle_shards=False))) == 1
