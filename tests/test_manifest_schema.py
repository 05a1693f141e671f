"""The manifest's values are checked as every other bundle file's (audit s13, F11): a UTC timestamp
that "newest" compares as a time, no coercion, known text fields, canaries present, and explicit
upper bounds on per-query work; each refusal names its field. Real bundles on disk, real reads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.api.settings import Settings
from service.engine.bundle import Bundle
from service.engine.schema import MAX_EF_SEARCH, MAX_SOURCE_K, BundleError
from service.engine.store import list_bundles, newest_version, read_manifest
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
