"""The README as a contract, checked both ways where it can be exhaustive: every setting, CLI flag,
error code, metric and event the code has is named there, and every one named there exists.
Users configure, script and alert from these names; a rename or an addition the README misses
(SHORTLIST_MAX_LINE_CHARS was documented and refused as unknown; five settings were never
documented) is a break they cannot see."""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path

import httpx
from _api_helpers import sample_titles

from service.api.settings import ENV_PREFIX, Settings
from service.engine.schema import FORMAT_VERSION, READABLE_FORMATS
from shortlist.cli import build_parser
from shortlist.testing import serve

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CODE = re.compile(r"[a-z]+(?:_[a-z]+)*")


def _sources(*folders: str) -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(encoding="utf-8"))) for f in folders for p in sorted((ROOT / f).rglob("*.py"))]


def test_every_setting_is_in_the_readme_and_every_variable_it_names_is_a_setting():
    missing = [f for f in Settings.model_fields
               if not re.search(rf"(?<![A-Z_])(?:{ENV_PREFIX})?{f.upper()}(?![A-Z_])", README)]
    assert missing == []
    named = set(re.findall(rf"{ENV_PREFIX}([A-Z0-9_]+)", README))
    assert sorted(n for n in named if n.lower() not in Settings.model_fields) == []


# What an unset setting does, where the prose says more than "unset".
UNSET_MEANS = {"version": "the recorded version, else the newest", "max_normalized_chars": "2 x `MAX_TEXT_CHARS`",
               "admin_token": "admin routes off", "state_dir": "nothing remembered",
               "admin_port": "admin routes on `PORT`", "quality_gate_min_p1": "no gate",
               "forwarded_allow_ips": "no proxy believed", "admin_host": "`HOST`", "cors_origins": "no CORS headers"}


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def settings_rows() -> list[str]:
    """The README's settings table as service/api/settings.py defines it: one row a setting,
    `| SHORTLIST_NAME | default | range |`."""
    from annotated_types import Ge, Gt, Le, Lt

    rows = []
    for name, field in Settings.model_fields.items():
        low = next((_number(m.ge) for m in field.metadata if isinstance(m, Ge)), "")
        low = next((f">{_number(m.gt)}" for m in field.metadata if isinstance(m, Gt)), low)
        high = next((_number(m.le) for m in field.metadata if isinstance(m, Le)), "")
        high = next((f"<{_number(m.lt)}" for m in field.metadata if isinstance(m, Lt)), high)
        default = field.default
        if default in (None, ""):
            shown = f"unset: {UNSET_MEANS[name]}" if name in UNSET_MEANS else "unset"
        elif isinstance(default, bool):
            shown = str(default).lower()
        elif isinstance(default, int | float):
            shown = _number(default)
        else:
            shown = f"`{default}`"
        rows.append(f"| `{ENV_PREFIX}{name.upper()}` | {shown} | {f'{low}..{high}' if low or high else ''} |")
    return rows


def test_the_readme_settings_table_is_every_setting_with_its_default_and_range():
    start = README.index("| variable | default | range |")
    table = README[start:].split("\n\n", 1)[0].splitlines()[2:]
    assert table == settings_rows()


def _flags(parser: argparse.ArgumentParser, command: str = "") -> dict[str, set[str]]:
    """Command ("labels add") -> its long options, for every (sub)command."""
    out: dict[str, set[str]] = {command: set()}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.update(_flags(sub, f"{command} {name}".strip()))
        else:
            out[command] |= {o for o in action.option_strings if o.startswith("--") and o != "--help"}
    return out


def test_every_cli_flag_is_in_the_readme_usage_and_every_usage_flag_exists():
    commands = {c: f for c, f in _flags(build_parser()).items() if c}
    usage = [line.split("#")[0] for line in README.splitlines() if line.startswith(".venv/bin/shortlist ")]
    documented: dict[str, set[str]] = {}
    for line in usage:
        words = line.split()[1:]
        command = " ".join(words[:2]) if " ".join(words[:2]) in commands else words[0]
        documented.setdefault(command, set()).update(re.findall(r"--[a-z][a-z0-9-]*", line))
    for command, flags in commands.items():
        if command in ("data", "labels"):
            continue  # groups: their subcommands hold the flags
        assert flags <= documented.get(command, set()), (command, sorted(flags - documented.get(command, set())))
        assert documented.get(command, set()) <= flags, (command, sorted(documented[command] - flags))


def _answered_codes() -> set[str]:
    """Every `error` code the service's sources put in an error body: ApiError(status, CODE),
    BodyRefused(CODE), error_json(CODE), and a 4xx/5xx status beside a code (a refusal tuple, a
    status -> code table, the HAProxy front's error files)."""
    codes: set[str] = set()
    for _, tree in _sources("service"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", ""))
                position = {"ApiError": 1, "BodyRefused": 0, "error_json": 0}.get(name)
                if position is not None and len(node.args) > position and isinstance(node.args[position], ast.Constant):
                    codes.add(node.args[position].value)
                if name == "get" and getattr(node.func.value, "id", "").endswith("_CODES") and _code(node.args[-1]):
                    codes.add(node.args[-1].value)  # the status -> code table's fallback
            if isinstance(node, ast.Call | ast.Tuple):
                items = node.args if isinstance(node, ast.Call) else node.elts
                codes |= {b.value for a, b in zip(items, items[1:], strict=False) if _status(a) and _code(b)}
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if _status(key):
                        values = value.elts if isinstance(value, ast.Tuple) else [value]
                        codes |= {v.value for v in values if _code(v)}
    return codes


def _status(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int and 400 <= node.value < 600


def _code(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and CODE.fullmatch(node.value) is not None


def _table_column(heading: str, column: int) -> set[str]:
    """The backticked names in `column` of the README table whose header row starts with `heading`."""
    start = README.index(heading)
    rows = README[start:].split("\n\n", 1)[0].splitlines()[2:]
    return {name for row in rows for name in re.findall(r"`([a-z_]+)`", row.split("|")[column])}


def test_every_error_code_answered_is_in_the_readme_table_and_every_listed_one_is_answered():
    answered, listed = _answered_codes(), _table_column("| status | `error` | when |", 2)
    assert "overloaded" in answered and "state_unavailable" in answered and "invalid_encoding" in answered
    assert sorted(answered - listed) == [] and sorted(listed - answered) == []


def test_every_event_logged_is_named_in_the_readme():
    events = set()
    for _, tree in _sources("service"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "log_event" and _code(node.args[0]):
                events.add(node.args[0].value)
            if isinstance(node, ast.Dict):
                events |= {v.value for k, v in zip(node.keys, node.values, strict=True)
                           if isinstance(k, ast.Constant) and k.value == "event" and _code(v)}
    assert "bundle_activated" in events and "connection_refused" in events
    assert sorted(e for e in events if f"`{e}`" not in README) == []


def test_the_readme_bundle_table_names_the_format_version_export_writes():
    """The bundle table's manifest row said format 4 for a release writing format 5: a user
    checking what an engine reads against the README took the wrong version."""
    row = next(line for line in README.splitlines() if line.startswith("| `manifest.json` |"))
    written = re.search(r"format version \((\d+);", row)
    assert written is not None and int(written.group(1)) == FORMAT_VERSION
    # Each version after the first is said, in order, with what it added.
    said = [int(n) for n in re.findall(r"[;,] (\d+) ", row.split(")", 1)[0])]
    assert said == list(range(2, FORMAT_VERSION + 1))
    assert list(READABLE_FORMATS) == list(range(1, FORMAT_VERSION + 1)) and "every earlier format still read" in row


def test_every_metric_served_is_in_the_readme_table_and_every_listed_one_is_served(bundle_root, tmp_path):
    env = {"SHORTLIST_STATE_DIR": str(tmp_path / "state")}
    with serve(bundle_root, env=env, log_dir=tmp_path) as s:
        text = httpx.get(f"{s.url}/metrics").text
    # Each counter's and histogram's `_created` series is a family of its own, not a metric to list.
    served = {n for n in re.findall(r"^# TYPE (shortlist_[a-z_]+) ", text, re.M) if not n.endswith("_created")}
    # prometheus-client names a counter's family without `_total`; its samples carry it.
    served = {f"{name}_total" if f"{name}_total" in text else name for name in served}
    listed = _table_column("| metric | labels | what |", 1)
    assert sorted(served - listed) == [] and sorted(listed - served) == []


def test_every_shortlist_variable_the_repository_reads_or_sets_is_a_setting():
    """`serve` refuses an unknown SHORTLIST_* variable, so a script of ours using that prefix for
    something else (the load test's rate, the image build's state folder) stopped a server
    started from the same shell. Tests (which set unknown ones on purpose) and the results'
    history are left out."""
    skip = {ROOT / "tests", ROOT / "bench" / "out"}
    found: dict[str, str] = {}
    for path in ROOT.rglob("*"):
        inside = path.relative_to(ROOT).parts
        if (not path.is_file() or any(part.startswith(".") for part in inside[:-1]) or path.name == "RESULTS.md"
                or any(folder in path.parents for folder in skip)
                or path.suffix not in {".py", ".sh", ".yaml", ".yml", ".toml", ".md", ".cfg", ""}):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for name in re.findall(rf"(?<![A-Za-z0-9_]){ENV_PREFIX}([A-Z0-9_]+)", text):
            found.setdefault(name, str(path.relative_to(ROOT)))
    assert {n: where for n, where in found.items() if n.lower() not in Settings.model_fields} == {}


# The README's curl examples: `curl -s -XPOST localhost:8000PATH ... -d 'BODY'` (shell-continued).
CURL = re.compile(r"curl -s -XPOST localhost:8000(/\S+)[^`]*?-d '([^']*)'")


def _documented_answer(route: str) -> tuple[set[str], set[str]]:
    """The answer's fields and each result's, as the README's route table writes them after `->`."""
    row = next(line for line in README.splitlines() if line.startswith(f"| `POST {route}` |"))
    answer = row.split("->", 1)[1]
    top, _, per_result = answer.partition("[[")
    return set(re.findall(r'"(\w+)"', top)), set(re.findall(r'"(\w+)"', per_result))


def test_the_readmes_curl_examples_answer_as_the_readme_says(bundle_root, tmp_path, synthetic_data):
    """Each curl example of the README, sent as written (host, token and version substituted by the
    test server's), answers 200; a prediction's answer has the fields the route table documents."""
    examples = CURL.findall(README)
    assert {path for path, _ in examples} == {"/v1/predict", "/admin/bundles/activate"}, examples
    token = "readme-example-admin-token"
    fields, per_result = _documented_answer("/v1/predict")
    assert fields == {"version", "results"} and per_result == {"id", "uid", "title", "score"}
    title = sample_titles(synthetic_data, 1)[0]
    with serve(bundle_root, env={"SHORTLIST_ADMIN_TOKEN": token}, log_dir=tmp_path) as s:
        for path, body in examples:
            r = httpx.post(f"{s.url}{path}", content=body, headers={
                "content-type": "application/json", "authorization": f"Bearer {token}"})
            assert r.status_code == 200, (path, r.text)
            if path == "/v1/predict":
                assert set(r.json()) == fields
                # The same request on a text of the test bundle's vocabulary: the results' fields.
                answer = httpx.post(f"{s.url}{path}", json={**json.loads(body), "text": title}).json()
                assert answer["results"][0] and all(set(item) == per_result for item in answer["results"][0])
