"""Settings errors from the real `shortlist serve` (and serve-ray): one line per problem naming the
SHORTLIST_* variable or the flag, exit 2, and never the admin token (audit s13 F4)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from service.api.settings import Settings, SettingsError, load_settings, secret_fields

TOKEN = "s3cr3t-t0ken-F4"
PREFIX = "shortlist serve: error: "


def _run(args: list[str], env: dict[str, str], tmp_path: Path, command: str = "serve") -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SHORTLIST_")}
    # A bundle root that does not exist: were the settings accepted, serve would stop on it
    # ("bundle root ... is not a directory") instead of naming the setting the test expects.
    base.update({"SHORTLIST_ADMIN_TOKEN": TOKEN, "SHORTLIST_BUNDLE_ROOT": str(tmp_path / "no-root"), **env})
    return subprocess.run([sys.executable, "-m", "shortlist.cli", command, *args], capture_output=True, text=True,
                          timeout=120, env=base)


def _assert_refused(r: subprocess.CompletedProcess, expected: list[str], prefix: str = PREFIX) -> None:
    assert r.returncode == 2, r.stderr
    assert TOKEN not in r.stdout and TOKEN not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == len(expected), r.stderr
    for line, want in zip(lines, expected, strict=True):
        assert line.startswith(prefix) and want in line, (line, want)
    for noise in ("Traceback", "input_value", "pydantic", "validation error for", "value_error"):
        assert noise not in r.stderr


CASES = [
    ("processes without a state dir", {"SHORTLIST_PROCESSES": "2"}, [],
     ["SHORTLIST_PROCESSES=2 needs SHORTLIST_STATE_DIR"]),
    ("processes with an admin port", {"SHORTLIST_PROCESSES": "2", "SHORTLIST_STATE_DIR": "/tmp",
                                      "SHORTLIST_ADMIN_PORT": "9001"}, [],
     ["SHORTLIST_PROCESSES=2 needs SHORTLIST_ADMIN_PORT unset"]),
    ("normalized limit one below the text limit", {"SHORTLIST_MAX_TEXT_CHARS": "101",
                                                    "SHORTLIST_MAX_NORMALIZED_CHARS": "100"}, [],
     ["SHORTLIST_MAX_NORMALIZED_CHARS=100 is below SHORTLIST_MAX_TEXT_CHARS=101"]),
    ("a variable that is not a number", {"SHORTLIST_MAX_K": "abc"}, [],
     ["SHORTLIST_MAX_K='abc': input should be a valid integer"]),
    ("the port flag one past its edge", {}, ["--port", "65536"],
     ["--port 65536: input should be less than or equal to 65535"]),
    ("the processes flag without a state dir", {}, ["--processes", "2"], ["--processes=2 needs SHORTLIST_STATE_DIR"]),
    ("a flag and a variable wrong at once", {"SHORTLIST_WORKERS": "0"}, ["--port", "99999"],
     ["--port 99999: input should be less than or equal to 65535",
      "SHORTLIST_WORKERS='0': input should be greater than or equal to 1"]),
    ("an unknown variable", {"SHORTLIST_ADMIN_TOKN": TOKEN}, [], ["unknown setting(s) SHORTLIST_ADMIN_TOKN"]),
]


@pytest.mark.parametrize(("what", "env", "args", "expected"), CASES, ids=[c[0] for c in CASES])
def test_serve_names_each_bad_setting_on_one_line_without_the_token(tmp_path, what, env, args, expected):
    _assert_refused(_run(args, env, tmp_path), expected)


def test_settings_at_their_edge_are_accepted_by_serve(tmp_path):
    # The same cross-checks at their edge pass: serve goes on to the (missing) bundle root.
    env = {"SHORTLIST_MAX_TEXT_CHARS": "100", "SHORTLIST_MAX_NORMALIZED_CHARS": "100"}
    r = _run(["--port", "65535"], env, tmp_path)
    assert r.returncode == 2 and "bundle root" in r.stderr and TOKEN not in r.stderr + r.stdout


def test_serve_ray_checks_the_settings_before_starting_ray(tmp_path):
    pytest.importorskip("ray")
    r = _run(["--bundle-root", str(tmp_path), "--shards", "1"], {"SHORTLIST_MAX_K": "0"}, tmp_path, "serve-ray")
    _assert_refused(r, ["SHORTLIST_MAX_K='0': input should be greater than or equal to 1"],
                    "shortlist serve-ray: error: ")
    r = _run(["--bundle-root", str(tmp_path), "--shards", "1", "--port", "65536"], {}, tmp_path, "serve-ray")
    _assert_refused(r, ["--port 65536: input should be less than or equal to 65535"], "shortlist serve-ray: error: ")


def test_a_secret_value_is_never_shown_even_where_a_message_would_quote_it(monkeypatch):
    # The token set as the value of a setting whose error names its value: masked.
    monkeypatch.setenv("SHORTLIST_ADMIN_TOKEN", "abc")
    monkeypatch.setenv("SHORTLIST_MAX_K", "abc")
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert "abc" not in str(caught.value) and "SHORTLIST_MAX_K='***'" in str(caught.value)
    assert caught.value.__suppress_context__  # no chained pydantic report in a traceback


def test_every_setting_named_like_a_secret_is_typed_secret():
    # Only SecretStr settings are kept out of messages: a new token, key or password setting
    # typed str would be shown.
    secret_words = {"token", "password", "passphrase", "secret", "key", "credential", "credentials"}
    named = {name for name in Settings.model_fields if secret_words & set(re.split(r"_", name))}
    assert "admin_token" in named and named <= secret_fields()
