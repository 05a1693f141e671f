"""Small files read by name (a bundle's manifest.json, the state directory's active.json) cannot hang
or exhaust the service: a FIFO, a device, a symlink out of the bundle or a file past its limit is
refused, naming it, and the serving bundle keeps serving (audit s13, F2 and F3)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from service.api.active_state import MAX_ACTIVE_FILE_BYTES, ActiveVersionFile
from service.engine.bundle import Bundle
from service.engine.manifests import list_bundles, read_manifest
from service.engine.schema import MAX_MANIFEST_BYTES, BundleError
from shortlist.testing import serve

TOKEN = "s3cret-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def padded_copy(root: Path, source: str, version: str, size: int) -> Path:
    """ROOT/version: a copy of `source` renamed, its manifest padded with trailing spaces to exactly `size` bytes."""
    dst = root / version
    shutil.copytree(root / source, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["version"] = version
    data = json.dumps(manifest).encode()
    assert len(data) <= size
    (dst / "manifest.json").write_bytes(data + b" " * (size - len(data)))
    return dst


def test_a_manifest_of_exactly_the_limit_loads_and_one_byte_more_is_refused(bundle_root_copy):
    path = padded_copy(bundle_root_copy, "v1", "edge", 40_000)
    assert read_manifest(path, max_bytes=40_000).version == "edge"
    with pytest.raises(BundleError, match=r"manifest\.json: 40000 bytes, more than the limit of 39999"):
        read_manifest(path, max_bytes=39_999)
    assert {m.version for m in list_bundles(bundle_root_copy, 40_000)} == {"v1", "v2", "edge"}
    assert "edge" not in [m.version for m in list_bundles(bundle_root_copy, 39_999)]
    # The default is the named constant.
    big = padded_copy(bundle_root_copy, "v1", "big", MAX_MANIFEST_BYTES + 1)
    with pytest.raises(BundleError, match=f"more than the limit of {MAX_MANIFEST_BYTES}"):
        read_manifest(big)


def test_a_fifo_or_dev_zero_manifest_is_refused_at_once(bundle_root_copy):
    (bundle_root_copy / "fifo").mkdir()
    os.mkfifo(bundle_root_copy / "fifo" / "manifest.json")
    (bundle_root_copy / "zero").mkdir()
    os.symlink("/dev/zero", bundle_root_copy / "zero" / "manifest.json")
    t0 = time.monotonic()
    with pytest.raises(BundleError, match=r"fifo/manifest\.json: a FIFO, not a regular file"):
        read_manifest(bundle_root_copy / "fifo")
    with pytest.raises(BundleError, match=r"zero/manifest\.json: a symlink leading outside the bundle directory"):
        read_manifest(bundle_root_copy / "zero")
    assert [m.version for m in list_bundles(bundle_root_copy)] == ["v1", "v2"]
    assert time.monotonic() - t0 < 5


def test_active_json_past_its_limit_or_a_fifo_is_refused_naming_it(tmp_path, caplog):
    state = ActiveVersionFile(tmp_path)
    record = json.dumps({"version": "v1", "history": ["v2"]}).encode()
    state.path.write_bytes(record + b" " * (MAX_ACTIVE_FILE_BYTES - len(record)))
    assert state.read() == "v1" and state.history() == ["v2"]
    state.path.write_bytes(record + b" " * (MAX_ACTIVE_FILE_BYTES + 1 - len(record)))
    with caplog.at_level("ERROR", logger="shortlist.state"):
        assert state.read() is None and state.history() == []
    assert f"active.json: {MAX_ACTIVE_FILE_BYTES + 1} bytes, more than the limit of {MAX_ACTIVE_FILE_BYTES}" \
        in caplog.text
    state.path.unlink()
    os.mkfifo(state.path)
    assert state.read() is None and "active.json: a FIFO, not a regular file" in caplog.text
    state.path.unlink()
    os.symlink("/dev/zero", state.path)
    assert state.read() is None and "active.json: a symlink, not followed" in caplog.text


def test_bad_manifests_never_block_listing_or_activation_and_the_limit_is_a_setting(bundle_root_copy, tmp_path):
    """One server: a FIFO active.json at start-up, then a FIFO manifest, a /dev/zero one and one past
    SHORTLIST_MAX_MANIFEST_BYTES (one of exactly the limit activates). The old code hung at start-up
    and in every listing (each call pinning a loader thread for good)."""
    limit = 40_000
    (bundle_root_copy / "fifo").mkdir()
    os.mkfifo(bundle_root_copy / "fifo" / "manifest.json")
    (bundle_root_copy / "zero").mkdir()
    os.symlink("/dev/zero", bundle_root_copy / "zero" / "manifest.json")
    padded_copy(bundle_root_copy, "v1", "big", limit + 1)
    padded_copy(bundle_root_copy, "v1", "edge", limit)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    os.mkfifo(state_dir / "active.json")
    env = {"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_STATE_DIR": str(state_dir),
           "SHORTLIST_MAX_MANIFEST_BYTES": str(limit)}
    with serve(bundle_root_copy, version="v2", env=env, log_dir=tmp_path) as s, \
            httpx.Client(base_url=s.url, headers=AUTH, timeout=20) as c:
        assert c.get("/readyz").json()["version"] == "v2"
        assert "active.json: a FIFO, not a regular file" in s.log()
        for _ in range(10):  # more calls than the registry has loader threads
            listing = c.get("/admin/bundles")
            assert listing.status_code == 200, listing.text
            assert {b["version"] for b in listing.json()["bundles"]} == {"v1", "v2", "edge"}
        for version, reason in (("fifo", "fifo/manifest.json: a FIFO, not a regular file"),
                                ("zero", "zero/manifest.json: a symlink leading outside the bundle directory"),
                                ("big", f"big/manifest.json: {limit + 1} bytes, more than the limit of {limit}")):
            r = c.post("/admin/bundles/activate", json={"version": version})
            assert r.status_code == 422 and reason in r.json()["message"], r.text
            assert c.post("/v1/predict", json={"text": "x"}).json()["version"] == "v2"
        r = c.post("/admin/bundles/activate", json={"version": "edge"})
        assert r.status_code == 200 and r.json()["active"] == "edge", r.text
        assert json.loads((state_dir / "active.json").read_text())["version"] == "edge"


def test_a_listed_bundle_file_that_is_a_fifo_is_refused_as_such(bundle_root_copy):
    """Every bundle file goes through the manifest's rule (small_files.bundle_file): a FIFO is named as
    one (it was called "missing" before), and never opened, so never waited on."""
    (bundle_root_copy / "v1" / "labels.jsonl").unlink()
    os.mkfifo(bundle_root_copy / "v1" / "labels.jsonl")
    t0 = time.monotonic()
    with pytest.raises(BundleError, match=r"v1/labels\.jsonl: a FIFO, not a regular file"):
        Bundle.open(bundle_root_copy / "v1")
    assert time.monotonic() - t0 < 5
