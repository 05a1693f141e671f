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

TOKEN = "s3cr3t-admin-t0ken-F4"
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
    ("the bundle check interval past its edge", {"SHORTLIST_BUNDLE_CHECK_INTERVAL_S": "3600.5"}, [],
     ["SHORTLIST_BUNDLE_CHECK_INTERVAL_S='3600.5': input should be less than or equal to 3600"]),
    ("a negative bundle check interval", {"SHORTLIST_BUNDLE_CHECK_INTERVAL_S": "-0.1"}, [],
     ["SHORTLIST_BUNDLE_CHECK_INTERVAL_S='-0.1': input should be greater than or equal to 0"]),
    # Audit 5 B10: limits with no upper bound (MAX_K=10^12 let one request take 17.8 GB; inf was a traceback).
    ("the answer's slots one past their bound", {"SHORTLIST_MAX_BATCH": "10000", "SHORTLIST_MAX_K": "1000",
                                                  "SHORTLIST_MAX_EXCLUDE": "1"}, [],
     ["SHORTLIST_MAX_BATCH x (SHORTLIST_MAX_K + SHORTLIST_MAX_EXCLUDE) = 10,010,000 label slots one request may "
      "make the engine hold, past 10,000,000"]),
    ("k past its bound", {"SHORTLIST_MAX_K": "1000000000000"}, [],
     ["SHORTLIST_MAX_K='1000000000000': input should be less than or equal to 100000"]),
    ("an endless drain", {"SHORTLIST_DRAIN_TIMEOUT_S": "inf"}, [],
     ["SHORTLIST_DRAIN_TIMEOUT_S='inf': input should be less than or equal to 86400"]),
    ("a body limit past its bound", {"SHORTLIST_MAX_BODY_BYTES": "99999999999999999999"}, [],
     ["SHORTLIST_MAX_BODY_BYTES='99999999999999999999': input should be less than or equal to 1073741824"]),
    ("a variable that is not a number", {"SHORTLIST_MAX_K": "abc"}, [],
     ["SHORTLIST_MAX_K='abc': input should be a valid integer"]),
    ("the port flag one past its edge", {}, ["--port", "65536"],
     ["--port 65536: input should be less than or equal to 65535"]),
    ("the processes flag without a state dir", {}, ["--processes", "2"], ["--processes=2 needs SHORTLIST_STATE_DIR"]),
    ("a flag and a variable wrong at once", {"SHORTLIST_WORKERS": "0"}, ["--port", "99999"],
     ["--port 99999: input should be less than or equal to 65535",
      "SHORTLIST_WORKERS='0': input should be greater than or equal to 1"]),
    ("an unknown variable", {"SHORTLIST_ADMIN_TOKN": TOKEN}, [], ["unknown setting(s) SHORTLIST_ADMIN_TOKN"]),
    # Audit s13 G8: what the container's entry let through.
    ("a token one character", {"SHORTLIST_ADMIN_TOKEN": "x"}, [],
     ["SHORTLIST_ADMIN_TOKEN is shorter than SHORTLIST_ADMIN_TOKEN_MIN_CHARS=16 characters: generate one"]),
    ("a token one character short", {"SHORTLIST_ADMIN_TOKEN": TOKEN[:15]}, [],
     ["SHORTLIST_ADMIN_TOKEN is shorter than SHORTLIST_ADMIN_TOKEN_MIN_CHARS=16 characters"]),
    ("a token one short of a raised minimum",
     {"SHORTLIST_ADMIN_TOKEN": TOKEN[:16], "SHORTLIST_ADMIN_TOKEN_MIN_CHARS": "17"}, [],
     ["SHORTLIST_ADMIN_TOKEN is shorter than SHORTLIST_ADMIN_TOKEN_MIN_CHARS=17 characters"]),
    ("a minimum below the floor", {"SHORTLIST_ADMIN_TOKEN_MIN_CHARS": "15"}, [],
     ["SHORTLIST_ADMIN_TOKEN_MIN_CHARS='15': input should be greater than or equal to 16"]),
    ("the README's old placeholder", {"SHORTLIST_ADMIN_TOKEN": "change-me"}, [],
     ["SHORTLIST_ADMIN_TOKEN is the placeholder of an example"]),
    ("a token ending in a space", {"SHORTLIST_ADMIN_TOKEN": TOKEN + " "}, [],
     ["SHORTLIST_ADMIN_TOKEN starts or ends with white space"]),
    # Audit s14 L2: tokens no client can send (a header line is visible ASCII), by their character, never shown.
    ("a token with a space inside", {"SHORTLIST_ADMIN_TOKEN": TOKEN[:8] + " " + TOKEN[8:]}, [],
     ["SHORTLIST_ADMIN_TOKEN holds U+0020 at character 9: a client's Authorization header carries visible ASCII"]),
    ("a token with a non-ASCII letter", {"SHORTLIST_ADMIN_TOKEN": TOKEN + "é"}, [],
     [f"SHORTLIST_ADMIN_TOKEN holds U+00E9 at character {len(TOKEN) + 1}"]),
    ("a token one past the longest", {"SHORTLIST_ADMIN_TOKEN": "a" * 4097}, [],
     ["SHORTLIST_ADMIN_TOKEN is longer than 4096 characters"]),
    # Audit s14 L7: hosts serve cannot bind stopped it after the bundle loaded (exit 3).
    ("a host that does not resolve", {"SHORTLIST_HOST": "no.such.host.invalid"}, [],
     ["SHORTLIST_HOST='no.such.host.invalid': not an IP address nor a name that resolves"]),
    ("a host with a user part", {"SHORTLIST_HOST": "user@127.0.0.1"}, [],
     ["SHORTLIST_HOST='user@127.0.0.1': not an IP address nor a name that resolves"]),
    ("the host flag bracketing a name", {}, ["--host", "[localhost]"],
     ["--host [localhost]: brackets hold an IPv6 address only"]),
    ("an admin host bracketing an IPv4 address", {"SHORTLIST_ADMIN_HOST": "[127.0.0.1]"}, [],
     ["SHORTLIST_ADMIN_HOST='[127.0.0.1]': brackets hold an IPv6 address only"]),
    ("a version that cannot be a bundle's", {"SHORTLIST_VERSION": "../x"}, [],
     ["SHORTLIST_VERSION='../x': invalid bundle version: use 1-64 letters"]),
    ("a version one character too long", {"SHORTLIST_VERSION": "v" * 65}, [], ["SHORTLIST_VERSION='vvv"]),
    ("the version flag", {}, ["--version", ".."], ["--version ..: invalid bundle version"]),
    ("the admin port on the main port", {"SHORTLIST_PORT": "9000", "SHORTLIST_ADMIN_PORT": "9000"}, [],
     ["SHORTLIST_ADMIN_PORT=9000 equals SHORTLIST_PORT: the admin routes need a port of their own"]),
    ("the admin port on the port flag", {"SHORTLIST_ADMIN_PORT": "9000", "SHORTLIST_ADMIN_HOST": "0.0.0.0"},
     ["--port", "9000"], ["SHORTLIST_ADMIN_PORT=9000 equals --port"]),
    # A name and the address it resolves to are one address (uvicorn stopped after loading, exit 3).
    # The data files' line limit (read by the offline commands) is a setting like any other.
    ("the line limit one below its edge", {"SHORTLIST_MAX_LINE_CHARS": "1023"}, [],
     ["SHORTLIST_MAX_LINE_CHARS='1023': input should be greater than or equal to 1024"]),
    ("the line limit one past its edge", {"SHORTLIST_MAX_LINE_CHARS": str((1 << 31) + 1)}, [],
     ["SHORTLIST_MAX_LINE_CHARS='2147483649': input should be less than or equal to 2147483648"]),
    ("a trusted proxy that is no address", {"SHORTLIST_FORWARDED_ALLOW_IPS": "127.0.0.1,proxy.local"}, [],
     ["SHORTLIST_FORWARDED_ALLOW_IPS='127.0.0.1,proxy.local': 'proxy.local' is not an IP address, a network"]),
    # An origin a browser never sends in Origin would match nothing: every call from the page
    # failing in the browser, nothing in the server's log.
    ("an origin with a path", {"SHORTLIST_CORS_ORIGINS": "https://app.example/ui"}, [],
     ["SHORTLIST_CORS_ORIGINS='https://app.example/ui': 'https://app.example/ui' is not an origin"]),
    ("an origin without a scheme", {"SHORTLIST_CORS_ORIGINS": "https://a.example, app.example"}, [],
     ["'app.example' is not an origin: scheme://host[:port]"]),
    ("an origin's port past 65535", {"SHORTLIST_CORS_ORIGINS": "http://localhost:65536"}, [],
     ["'http://localhost:65536' is not an origin"]),
    ("the admin port on a name for the host", {"SHORTLIST_PORT": "9000", "SHORTLIST_ADMIN_PORT": "9000",
                                               "SHORTLIST_ADMIN_HOST": "localhost"}, [],
     ["SHORTLIST_ADMIN_PORT=9000 equals SHORTLIST_PORT"]),
    ("the admin port on the host's bracketed form", {"SHORTLIST_HOST": "::1", "SHORTLIST_PORT": "9000",
                                                     "SHORTLIST_ADMIN_PORT": "9000", "SHORTLIST_ADMIN_HOST": "[::1]"},
     [], ["SHORTLIST_ADMIN_PORT=9000 equals SHORTLIST_PORT"]),
]


@pytest.mark.parametrize(("what", "env", "args", "expected"), CASES, ids=[c[0] for c in CASES])
def test_serve_names_each_bad_setting_on_one_line_without_the_token(tmp_path, what, env, args, expected):
    r = _run(args, env, tmp_path)
    _assert_refused(r, expected)
    # A refused token is not shown either (one or two characters would be in any sentence).
    refused_token = env.get("SHORTLIST_ADMIN_TOKEN", TOKEN)
    assert len(refused_token) < 3 or refused_token not in r.stderr + r.stdout


EDGES = [
    ("limits", {"SHORTLIST_MAX_TEXT_CHARS": "100", "SHORTLIST_MAX_NORMALIZED_CHARS": "100"}, ["--port", "65535"]),
    ("a token of the minimum length", {"SHORTLIST_ADMIN_TOKEN": TOKEN[:16]}, []),
    ("a token of the longest length, every visible ASCII character", {"SHORTLIST_ADMIN_TOKEN": (
        "".join(map(chr, range(0x21, 0x7F))) * 44)[:4096]}, []),
    ("a token of a raised minimum", {"SHORTLIST_ADMIN_TOKEN": TOKEN[:17], "SHORTLIST_ADMIN_TOKEN_MIN_CHARS": "17"}, []),
    ("hosts serve can bind", {"SHORTLIST_HOST": "[::]", "SHORTLIST_ADMIN_HOST": "localhost"}, []),
    ("a version of 64 characters", {"SHORTLIST_VERSION": "v" * 64}, []),
    ("the bundle check interval at its edges", {"SHORTLIST_BUNDLE_CHECK_INTERVAL_S": "3600"}, []),
    ("the bundle check off", {"SHORTLIST_BUNDLE_CHECK_INTERVAL_S": "0"}, []),
    ("an admin port beside the port", {"SHORTLIST_ADMIN_PORT": "9001"}, ["--port", "9000"]),
    # Another address may take the same port; port 0 picks a free one for each server.
    ("the same port on another address", {"SHORTLIST_ADMIN_PORT": "9000", "SHORTLIST_ADMIN_HOST": "127.0.0.2"},
     ["--port", "9000"]),
    ("both ports picked free", {"SHORTLIST_ADMIN_PORT": "0"}, ["--port", "0"]),
    ("the answer's slots at their bound", {"SHORTLIST_MAX_BATCH": "10000", "SHORTLIST_MAX_K": "999",
                                           "SHORTLIST_MAX_EXCLUDE": "1", "SHORTLIST_MAX_QUEUED_TEXTS": "10000"}, []),
    ("request limits at their upper bounds", {"SHORTLIST_MAX_K": "100000", "SHORTLIST_MAX_EXCLUDE": "0",
                                              "SHORTLIST_MAX_BATCH": "100", "SHORTLIST_MAX_BODY_BYTES": "1073741824",
                                              "SHORTLIST_DRAIN_TIMEOUT_S": "86400"}, []),
    # Documented for the data commands; serve was stopped by it as an unknown setting.
    ("the line limit at its edges", {"SHORTLIST_MAX_LINE_CHARS": "1024"}, []),
    ("the line limit at its upper edge", {"SHORTLIST_MAX_LINE_CHARS": str(1 << 31)}, []),
    ("origins at their edges", {"SHORTLIST_CORS_ORIGINS": "https://App.Example/, http://[::1]:65535,*"}, []),
    ("trusted proxies: addresses, a network, any",
     {"SHORTLIST_FORWARDED_ALLOW_IPS": "10.0.0.1, ::1,10.1.0.0/16,*"}, []),
]


@pytest.mark.parametrize(("what", "env", "args"), EDGES, ids=[e[0] for e in EDGES])
def test_settings_at_their_edge_are_accepted_by_serve(tmp_path, what, env, args):
    # The same checks at their edge pass: serve goes on to the (missing) bundle root.
    r = _run(args, env, tmp_path)
    assert r.returncode == 2 and "bundle root" in r.stderr and TOKEN not in r.stderr + r.stdout


def _token_file_run(tmp_path: Path, content: str | None, **env: str) -> subprocess.CompletedProcess:
    path = tmp_path / "admin-token"
    if content is not None:
        path.write_text(content)
    return _run([], {"SHORTLIST_ADMIN_TOKEN": "", "SHORTLIST_ADMIN_TOKEN_FILE": str(path), **env}, tmp_path)


def test_a_token_file_is_read_at_start_up_without_its_trailing_newline(tmp_path):
    # At the edge: 16 characters once the newline `echo` writes is dropped.
    r = _token_file_run(tmp_path, TOKEN[:16] + "\n")
    assert r.returncode == 2 and "bundle root" in r.stderr and TOKEN[:16] not in r.stderr + r.stdout
    # A newline is not a character of the token: 15 and a newline are too short.
    _assert_refused(_token_file_run(tmp_path, TOKEN[:15] + "\n"),
                    ["the token in SHORTLIST_ADMIN_TOKEN_FILE is shorter than SHORTLIST_ADMIN_TOKEN_MIN_CHARS=16"])
    _assert_refused(_token_file_run(tmp_path, ""), ["the token in SHORTLIST_ADMIN_TOKEN_FILE is shorter than"])


def test_a_token_file_that_cannot_be_read_is_named(tmp_path):
    path = tmp_path / "admin-token"
    named = f"SHORTLIST_ADMIN_TOKEN_FILE={path}: cannot be read: "
    _assert_refused(_token_file_run(tmp_path, None), [named + "no such file or directory"])
    path.mkdir()
    _assert_refused(_token_file_run(tmp_path, None), [named + "a directory, not a regular file"])
    path.rmdir()
    path.write_bytes(b"\xff" * 20)  # not text: no client could send it either
    _assert_refused(_token_file_run(tmp_path, None), [named + "'utf-8' codec can't decode"])


def test_a_token_file_is_read_no_further_than_a_token_may_be_long(tmp_path):
    # Audit s14 L2: a FIFO hung start-up, /dev/zero was a MemoryError traceback, 200 MB were read.
    path = tmp_path / "admin-token"
    named = f"SHORTLIST_ADMIN_TOKEN_FILE={path}: cannot be read: "
    os.mkfifo(path)
    _assert_refused(_token_file_run(tmp_path, None), [named + "a fifo, not a regular file"])
    path.unlink()
    path.symlink_to("/dev/zero")
    _assert_refused(_token_file_run(tmp_path, None), [named + "a character device, not a regular file"])
    path.unlink()
    _assert_refused(_token_file_run(tmp_path, "a" * 4099), [named + "4099 bytes, more than the limit of 4098"])
    _assert_refused(_token_file_run(tmp_path, "a" * 4097 + "\n"),
                    ["the token in SHORTLIST_ADMIN_TOKEN_FILE is longer than 4096 characters"])
    # At the edge, with the line end Windows editors write; and through a symlink (a Kubernetes secret).
    (tmp_path / "secret").write_text("a" * 4096 + "\r\n")
    path.unlink()
    path.symlink_to(tmp_path / "secret")
    r = _token_file_run(tmp_path, None)
    assert r.returncode == 2 and "bundle root" in r.stderr, r.stderr


@pytest.mark.parametrize(("content", "why"), [
    ("\ufeff" + TOKEN, "U+FEFF (a byte order mark) at character 1"),
    (TOKEN[:10] + "\0" + TOKEN[10:], "U+0000 at character 11"),
    (TOKEN + "\n" + TOKEN + "\n", f"U+000A at character {len(TOKEN) + 1}"),
    (TOKEN + "ß", f"U+00DF at character {len(TOKEN) + 1}"),
], ids=["a BOM", "a NUL", "two lines", "non-ASCII"])
def test_a_token_file_no_client_could_send_is_refused_at_start_up(tmp_path, content, why):
    # These started and then answered every admin request 403 (400): the admin API silently locked.
    _assert_refused(_token_file_run(tmp_path, content), [f"the token in SHORTLIST_ADMIN_TOKEN_FILE holds {why}: "])


def test_a_token_set_twice_is_refused(tmp_path):
    r = _token_file_run(tmp_path, TOKEN, SHORTLIST_ADMIN_TOKEN=TOKEN)
    _assert_refused(r, ["SHORTLIST_ADMIN_TOKEN and SHORTLIST_ADMIN_TOKEN_FILE are both set: set one"])


def test_serve_ray_checks_the_settings_before_starting_ray(tmp_path):
    pytest.importorskip("ray")
    r = _run(["--bundle-root", str(tmp_path), "--shards", "1"], {"SHORTLIST_MAX_K": "0"}, tmp_path, "serve-ray")
    _assert_refused(r, ["SHORTLIST_MAX_K='0': input should be greater than or equal to 1"],
                    "shortlist serve-ray: error: ")
    r = _run(["--bundle-root", str(tmp_path), "--shards", "1", "--port", "65536"], {}, tmp_path, "serve-ray")
    _assert_refused(r, ["--port 65536: input should be less than or equal to 65535"], "shortlist serve-ray: error: ")


def test_a_secret_value_is_never_shown_even_where_a_message_would_quote_it(monkeypatch):
    # The token set as the value of a setting whose error names its value: masked.
    monkeypatch.setenv("SHORTLIST_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv("SHORTLIST_MAX_K", TOKEN)
    with pytest.raises(SettingsError) as caught:
        load_settings()
    assert TOKEN not in str(caught.value) and "SHORTLIST_MAX_K='***'" in str(caught.value)
    assert caught.value.__suppress_context__  # no chained pydantic report in a traceback


def test_every_setting_named_like_a_secret_is_typed_secret():
    # Only SecretStr settings are kept out of messages: a new token, key or password setting
    # typed str would be shown.
    secret_words = {"token", "password", "passphrase", "secret", "key", "credential", "credentials"}
    # Named so, but not secrets: the path of the file holding the token, and a length.
    about_a_secret = {"admin_token_file", "admin_token_min_chars"}
    named = {name for name in Settings.model_fields if secret_words & set(re.split(r"_", name))}
    assert "admin_token" in named and named - about_a_secret <= secret_fields()


def test_labels_add_names_a_bad_setting_without_the_token(tmp_path):
    # `shortlist labels add` checks each label as the API would, under this environment's
    # settings: a bad one is named as `serve` names it, not in pydantic's report of every input.
    labels = tmp_path / "labels.jsonl"
    labels.write_text('{"uid": "n1", "title": "a new label"}\n')
    args = ["add", str(tmp_path / "no-bundle"), "--labels", str(labels)]
    r = _run(args, {"SHORTLIST_PROCESSES": "2"}, tmp_path, "labels")
    _assert_refused(r, ["SHORTLIST_PROCESSES=2 needs SHORTLIST_STATE_DIR"], "shortlist labels: error: ")
    r = _run(args, {"SHORTLIST_ADMIN_TOKEN": TOKEN[:15]}, tmp_path, "labels")
    _assert_refused(r, ["SHORTLIST_ADMIN_TOKEN is shorter than"], "shortlist labels: error: ")
    assert TOKEN[:15] not in r.stderr


def test_every_numeric_setting_has_both_bounds():
    """A limit without an upper bound lets a value through that kills the server (audit 5 B10)."""
    from annotated_types import Ge, Gt, Le, Lt

    unbounded = []
    for name, field in Settings.model_fields.items():
        kinds = {type(m) for m in field.metadata}
        if field.annotation in (int, float, int | None, float | None) and not (
                kinds & {Ge, Gt} and kinds & {Le, Lt}):
            unbounded.append(name)
    assert unbounded == []
