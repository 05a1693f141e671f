"""The manifest's values are checked as every other bundle file's (audit s13, F11): a UTC timestamp
that "newest" compares as a time, no coercion, known text fields, canaries present, and explicit
upper bounds on per-query work; each refusal names its field. Real bundles on disk, real reads."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.api.settings import Settings
from service.engine.bundle import Bundle
from service.engine.manifests import list_bundles, newest_version, read_manifest
from service.engine.schema import MAX_EF_SEARCH, MAX_SOURCE_K, BundleError
from service.engine.store import DERIVED_DIR, BundleStore
from service.engine.tree import MAX_BEAM


def variant(root: Path, version: str, edit) -> Path:
    """ROOT/version: a copy of v1 renamed, its manifest edited by edit(manifest)."""
    dst = root / version
    shutil.copytree(root / "v1", dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["version"] = version
    edit(manifest)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def setter(*path_and_value):
    *path, value = path_and_value

    def edit(m: dict) -> None:
        for key in path[:-1]:
            m = m[key]
        m[path[-1]] = value
    return edit


@pytest.mark.parametrize(("value", "fragment"), [
    ("yesterday", "not an ISO-8601 timestamp: 'yesterday'"),
    ("2026-11-27T06:02:16", "not a UTC timestamp"),  # no offset: whose clock?
    ("2026-11-27T06:02:16+02:00", "not a UTC timestamp"),
    ("", "not an ISO-8601 timestamp"),
])
def test_created_at_must_be_a_utc_timestamp(bundle_root_copy, value, fragment):
    path = variant(bundle_root_copy, "bad", setter("created_at", value))
    with pytest.raises(BundleError, match="created_at: Value error, " + fragment):
        read_manifest(path)
    assert "bad" not in {m.version for m in list_bundles(bundle_root_copy)}


def test_newest_compares_times_not_strings(bundle_root_copy):
    # As strings "...16Z" sorts after "...16.000001Z" ("Z" > "."); as times it is earlier.
    variant(bundle_root_copy, "later", setter("created_at", "2030-01-01T00:00:16.000001Z"))
    variant(bundle_root_copy, "earlier", setter("created_at", "2030-01-01T00:00:16Z"))
    variant(bundle_root_copy, "offset", setter("created_at", "2029-12-31T00:00:00+00:00"))
    assert [m.version for m in list_bundles(bundle_root_copy)][-3:] == ["offset", "earlier", "later"]
    assert newest_version(bundle_root_copy) == "later"


@pytest.mark.parametrize(("path", "value", "field"), [
    (("scoring", "shortlist", "k_tok"), "20", "scoring.shortlist.k_tok"),
    (("format_version", ), 5.0, "format_version"),
    (("dim", ), "32", "dim"),
    (("scoring", "alpha"), "0.5", "scoring.alpha"),
    (("hnsw", "ef_search"), 50.0, "hnsw.ef_search"),
    (("scoring", "shortlist", "k_head"), True, "scoring.shortlist.k_head"),
])
def test_values_are_never_coerced(bundle_root_copy, path, value, field):
    bad = variant(bundle_root_copy, "bad", setter(*path, value))
    with pytest.raises(BundleError, match=rf"invalid manifest: {field}: Input should be a valid"):
        read_manifest(bad)


def test_text_field_is_one_training_writes(bundle_root_copy):
    assert read_manifest(variant(bundle_root_copy, "both", setter("text_field", "title+content"))).text_field \
        == "title+content"
    with pytest.raises(BundleError, match="text_field: Input should be 'title' or 'title\\+content'"):
        read_manifest(variant(bundle_root_copy, "body", setter("text_field", "body")))


def test_an_empty_canary_list_is_refused(bundle_root_copy):
    path = variant(bundle_root_copy, "nocanary", setter("canary", []))
    with pytest.raises(BundleError, match=r"nocanary/manifest\.json: canary: empty"):
        Bundle.open(path)
    del_canary = variant(bundle_root_copy, "nokey", lambda m: m.pop("canary"))
    with pytest.raises(BundleError, match="canary: empty"):
        Bundle.open(del_canary)
    Bundle.open(bundle_root_copy / "v1").close()


@pytest.mark.parametrize(("path", "limit"), [
    (("scoring", "shortlist", "k_w"), MAX_SOURCE_K),
    (("scoring", "shortlist", "k_mu"), MAX_SOURCE_K),
    (("scoring", "shortlist", "k_head"), MAX_SOURCE_K),
    (("scoring", "shortlist", "k_tok"), MAX_SOURCE_K),
    (("scoring", "shortlist", "k_added"), MAX_SOURCE_K),
    (("hnsw", "ef_search"), MAX_EF_SEARCH),
])
def test_per_query_work_is_bounded_at_and_past_the_edge(bundle_root_copy, path, limit):
    at = read_manifest(variant(bundle_root_copy, "at", setter(*path, limit)))
    value = at
    for key in path:
        value = getattr(value, key)
    assert value == limit
    with pytest.raises(BundleError, match=rf"{'.'.join(path)}: Input should be less than or equal to {limit}"):
        read_manifest(variant(bundle_root_copy, "past", setter(*path, limit + 1)))


def test_the_services_beam_limit_is_bounded_by_the_engines():
    assert Settings(max_beam=MAX_BEAM).max_beam == MAX_BEAM
    with pytest.raises(ValidationError, match="max_beam"):
        Settings(max_beam=MAX_BEAM + 1)


def _rewrite_keeping_size_and_times(path: Path, text: str) -> None:
    """Rewrite a file in place to `text` (as long as before), its mtime and atime put back."""
    before = path.stat()
    assert len(text.encode()) == before.st_size
    path.write_text(text)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_listing_never_answers_a_manifest_as_it_was_before_it_changed(bundle_root_copy):
    """Listings reuse what they parsed while a manifest file is unchanged: a manifest rewritten in
    place (same size, mtime put back), a bundle directory replaced under its name, or a manifest
    turned invalid is listed as it now is at the next listing."""
    variant(bundle_root_copy, "v3", lambda m: m.update(created_at="2030-01-01T00:00:00Z"))
    manifest = bundle_root_copy / "v3" / "manifest.json"
    assert newest_version(bundle_root_copy) == "v3"
    _rewrite_keeping_size_and_times(manifest, manifest.read_text().replace("2030-01-01", "2001-01-01"))
    assert newest_version(bundle_root_copy) == "v2"
    assert [m.created_at for m in list_bundles(bundle_root_copy) if m.version == "v3"] == ["2001-01-01T00:00:00Z"]

    # The directory replaced by another under the same name (an operator's copy renamed in place).
    replacement = variant(bundle_root_copy, "v3-new", lambda m: m.update(created_at="2031-01-01T00:00:00Z"))
    shutil.rmtree(bundle_root_copy / "v3")
    manifest = replacement / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"v3-new"', '"v3"'))
    replacement.rename(bundle_root_copy / "v3")
    assert newest_version(bundle_root_copy) == "v3"

    _rewrite_keeping_size_and_times(bundle_root_copy / "v3" / "manifest.json",
                                    (bundle_root_copy / "v3" / "manifest.json").read_text().replace("{", "[", 1))
    assert "v3" not in {m.version for m in list_bundles(bundle_root_copy)}
    assert newest_version(bundle_root_copy) == "v2"


def test_a_label_change_made_with_the_clock_ahead_never_outranks_a_later_change(bundle_root_copy, tmp_path):
    """Label changes' versions STEM.labels-N are named in the order they are made: "newest" (what
    start-up serves when the record is gone) and the listing's order follow that order within a
    chain, whatever clock wrote each manifest (audit s25 F4: a change made a year ahead won)."""
    state = tmp_path / "state"
    derived = state / DERIVED_DIR
    derived.mkdir(parents=True)
    stamps = {1: "2026-01-01T00:00:00Z", 2: "2027-06-01T00:00:00Z", 3: "2026-01-02T00:00:00Z",
              4: "2026-01-03T00:00:00Z"}  # change 2 written with the clock 17 months ahead
    for n, stamp in stamps.items():
        lineage = {"parent": "v2" if n == 1 else f"v2.labels-{n - 1}", "base": "v2", "added": 1,
                   "retired": 0, "tree_labels": 1}
        path = variant(bundle_root_copy, f"v2.labels-{n}", lambda m, s=stamp, li=lineage: m.update(
            created_at=s, lineage=li))
        path.rename(derived / path.name)
    variant(bundle_root_copy, "v0", setter("created_at", "2020-06-01T00:00:00Z"))  # another chain
    store = BundleStore(bundle_root_copy, state)
    assert [b.version for b in store.list()] == ["v0", "v1", "v2", "v2.labels-1", "v2.labels-2", "v2.labels-3",
                                                 "v2.labels-4"]
    assert store.newest_version() == "v2.labels-4"
    # Ten changes: the tenth is newer than the ninth (not "v2.labels-10" < "v2.labels-9" as text).
    for n in range(5, 11):
        path = variant(bundle_root_copy, f"v2.labels-{n}", lambda m, n=n: m.update(
            created_at="2027-06-01T00:00:00Z",
            lineage={"parent": f"v2.labels-{n - 1}", "base": "v2", "added": 1, "retired": 0, "tree_labels": 1}))
        path.rename(derived / path.name)
    assert store.newest_version() == "v2.labels-10"
