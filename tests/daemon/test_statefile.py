"""The daemon's state file with real files: round trips, and every
way a file can be wrong (cut short, a bit flipped, another format, another
boot, a crash mid-write) detected, never returned."""

from __future__ import annotations

import os
import stat

import pytest

from kvelastic.daemon import statefile as sf

BOOT = sf.boot_id()
OTHER_BOOT = "00000000-0000-4000-8000-000000000000"


def written(tmp_path, payload=b"books" * 1000):
    path = tmp_path / "kvelastic.state"
    sf.write_state(path, payload, boot=BOOT)
    return path


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_state_written_is_read_back_whole_and_only_by_its_owner(tmp_path):
    path = written(tmp_path)
    assert sf.read_state(path, boot=BOOT) == b"books" * 1000
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    sf.write_state(path, b"", boot=BOOT)                       # replaced, and empty is a valid payload
    assert sf.read_state(path, boot=BOOT) == b""
    assert os.listdir(tmp_path) == ["kvelastic.state"]         # no temporary file left


@pytest.mark.parametrize(("damage", "error"), [
    (lambda p: p.write_bytes(p.read_bytes()[:-1]), sf.StateTorn),          # payload cut short
    (lambda p: p.write_bytes(p.read_bytes() + b"x"), sf.StateTorn),        # trailing bytes
    (lambda p: p.write_bytes(p.read_bytes()[:20]), sf.StateTorn),          # header cut short
    (lambda p: flip(p, 70), sf.StateChecksum),                             # a payload bit
    (lambda p: flip(p, 9), sf.StateChecksum),                              # a header bit (the length)
    (lambda p: flip(p, 0), sf.StateChecksum),                              # the magic
    (lambda p: p.unlink(), sf.StateMissing),
])
def test_a_damaged_state_file_is_never_returned(tmp_path, damage, error):
    path = written(tmp_path)
    damage(path)
    with pytest.raises(error) as caught:
        sf.read_state(path, boot=BOOT)
    assert caught.value.reason == error.reason


def test_another_format_version_is_refused_by_name(tmp_path):
    path = written(tmp_path)
    data = bytearray(path.read_bytes())
    data[4:6] = (sf.VERSION + 1).to_bytes(2, "little")
    head = bytes(data[:sf._HEADER.size])
    data[sf._HEADER.size:sf._HEADER.size + 4] = sf._CRC.pack(sf.zlib.crc32(head))   # a well-formed newer file
    path.write_bytes(bytes(data))
    with pytest.raises(sf.StateVersion, match=f"format version {sf.VERSION + 1}, this daemon reads {sf.VERSION}"):
        sf.read_state(path, boot=BOOT)


def test_a_state_from_before_the_last_boot_is_stale(tmp_path):
    path = tmp_path / "kvelastic.state"
    sf.write_state(path, b"books", boot=OTHER_BOOT)
    with pytest.raises(sf.StateStale):
        sf.read_state(path, boot=BOOT)
    assert sf.read_state(path, boot=OTHER_BOOT) == b"books"


def test_a_write_that_fails_leaves_the_old_state_and_no_temporary_file(tmp_path, monkeypatch):
    path = written(tmp_path, b"old")

    def full_disk(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sf.os, "write", full_disk)       # the one fault a real disk cannot give on demand
    with pytest.raises(OSError):
        sf.write_state(path, b"new" * 1000, boot=BOOT)
    monkeypatch.undo()
    assert sf.read_state(path, boot=BOOT) == b"old"
    assert os.listdir(tmp_path) == ["kvelastic.state"]


def test_a_crash_mid_write_leaves_the_old_state(tmp_path):
    path = written(tmp_path, b"old")
    (tmp_path / ".kvelastic.state.tmp").write_bytes(b"KVST half a")    # what a killed writer leaves
    assert sf.read_state(path, boot=BOOT) == b"old"
    sf.write_state(path, b"new", boot=BOOT)                             # the next write goes over it
    assert sf.read_state(path, boot=BOOT) == b"new" and os.listdir(tmp_path) == ["kvelastic.state"]


def test_a_boot_id_is_the_kernels():
    assert len(BOOT) == 36 and BOOT.count("-") == 4
    with pytest.raises(ValueError):
        sf.write_state("/nonexistent/x", b"", boot="short")


@pytest.mark.parametrize("spoil", ["group_writable", "world_readable", "symlink"])
def test_a_state_file_another_user_could_have_written_is_never_read(tmp_path, spoil):
    """It says which pages hold which namespace's KV: one others could write
    (or read, or a link to anywhere) is refused before a byte is read."""
    path = tmp_path / "kv.sock.state"
    sf.write_state(path, b"books", boot=BOOT)
    if spoil == "symlink":
        real = tmp_path / "elsewhere"
        path.rename(real)
        path.symlink_to(real)
    else:
        path.chmod(0o620 if spoil == "group_writable" else 0o604)
    with pytest.raises(sf.StateUntrusted) as err:
        sf.read_state(path, boot=BOOT)
    assert err.value.reason == "untrusted"
