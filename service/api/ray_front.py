"""HAProxy as `shortlist serve-ray` runs it in front of the ingress: Ray Serve's configuration,
amended so that every listener is on the host the operator named.

Ray Serve 2.60 renders its haproxy.cfg from a fixed template (ray/serve/_private/
haproxy_templates.py) with two listeners besides the service's: a stats page (`listen stats`,
`bind *:8404`) and a Prometheus exporter (`frontend prometheus`, `bind :9101`), on every interface
whatever `http_options.host` says; only their ports are settings. Its one hook on how HAProxy
runs is the binary (RAY_SERVE_HAPROXY_BINARY_PATH): `serve-ray` points it at a script that runs
this file, which rewrites the configuration Ray just wrote (under Ray's own lock on it) and then
execs the real HAProxy with Ray's arguments, so Ray supervises, reloads and stops it as before.
The rewrite drops those two sections (Ray reads HAProxy's state through its admin socket, not
through them), puts serve-ray's directives in the `defaults` section (a request head's deadline,
which Ray leaves unset; a connection closed silently if it never sent a byte) and first in the
service's front (the connection limit's 503, before Ray's rules answer anything), answers a path no
application is routed at (every path until the ingress is deployed) with the service's 503 instead of
Ray's plain-text 404, and refuses to start HAProxy (exit 1, the reason on stderr, in Ray's HAProxy
logs) if any `bind` line left listens elsewhere than the service's own front: a template that
changed is a refusal, not a listener nobody asked for.

Run as a script (`python -I -S ray_front.py`), before Ray has imported anything: the standard
library only.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import sys

# The sections of Ray's template that listen on every interface and that serve-ray turns off.
UNWANTED_SECTIONS = ("frontend prometheus", "listen stats")
FRONT_SECTION = "frontend http_frontend"
# Where Ray's front sends a request whose path no application's route prefix matches.
UNROUTED_SECTION = "backend default_backend"
_SECTION_KEYWORDS = ("global", "defaults", "frontend", "backend", "listen", "peers", "resolvers", "userlist",
                     "program", "http-errors", "ring", "cache", "mailers")


class FrontConfigError(ValueError):
    """Ray's configuration is not the shape this rewrite knows: HAProxy is not started."""


def _sections(text: str) -> list[list[str]]:
    """The configuration's lines grouped by section (a section starts at a keyword in column 0);
    lines before the first section form a group of their own."""
    groups: list[list[str]] = [[]]
    for line in text.splitlines():
        if line[:1].strip() and line.split()[0] in _SECTION_KEYWORDS:
            groups.append([])
        groups[-1].append(line)
    return groups


def _header(group: list[str]) -> str:
    return " ".join(group[0].split()) if group else ""


def _bind_addresses(group: list[str]) -> list[str]:
    """The address part (before the port) of each `bind` line of a section."""
    out = []
    for line in group[1:]:
        words = line.split()
        if words[:1] == ["bind"] and len(words) > 1:
            out.append(words[1].rpartition(":")[0])
    return out


def amend(text: str, directives: list[str], front_directives: tuple[str, ...] = (),
          unrouted: tuple[str, ...] = ()) -> str:
    """Ray's haproxy.cfg without its stats page and exporter, with `directives` in its defaults
    (each in place of Ray's with the same first two words, e.g. `timeout http-request`),
    `front_directives` first in the service's front (before Ray's rules, once) and `unrouted`, if
    given, in place of Ray's answer to a path no application is routed at;
    FrontConfigError if a listener would be left on another address than the service's front."""
    groups = [g for g in _sections(text) if _header(g) not in UNWANTED_SECTIONS]
    fronts = [g for g in groups if _header(g) == FRONT_SECTION]
    front_addresses = set(_bind_addresses(fronts[0])) if len(fronts) == 1 else set()
    if len(front_addresses) != 1:
        raise FrontConfigError(f"expected one `{FRONT_SECTION}` section binding one address")
    for group in groups:
        stray = set(_bind_addresses(group)) - front_addresses
        if stray:
            raise FrontConfigError(f"`{_header(group)}` would listen on {sorted(stray)}, not the service's "
                                   f"host {sorted(front_addresses)}")
    defaults = [g for g in groups if _header(g) == "defaults"]
    if len(defaults) != 1:
        raise FrontConfigError("expected one `defaults` section")
    section = defaults[0]
    replaced = {tuple(d.split()[:2]) for d in directives}
    section[1:] = [f"    {d}" for d in directives] + [
        line for line in section[1:] if tuple(line.split()[:2]) not in replaced]
    front = fronts[0]
    front[1:] = [f"    {d}" for d in front_directives] + [
        line for line in front[1:] if line.strip() not in front_directives]
    if unrouted:
        _replace_unrouted(groups, unrouted)
    return "\n".join(line for group in groups for line in group) + "\n"


def _replace_unrouted(groups: list[list[str]], unrouted: tuple[str, ...]) -> None:
    """Ray's `default_backend` answers a path no application is routed at with a plain-text 404
    ("Path '/readyz' not found"): with the service at "/", that is every request until the
    ingress is deployed (start-up). Its `http-request return` rules are replaced by `unrouted`."""
    backends = [g for g in groups if _header(g) == UNROUTED_SECTION]
    if len(backends) != 1:
        raise FrontConfigError(f"expected one `{UNROUTED_SECTION}` section")
    section = backends[0]
    section[1:] = [f"    {d}" for d in unrouted] + [
        line for line in section[1:] if line.split()[:2] != ["http-request", "return"]]


def rewrite(config_path: str, directives: list[str], front_directives: tuple[str, ...] = (),
            unrouted: tuple[str, ...] = ()) -> None:
    """Amend the file in place, under the lock Ray holds while it writes it."""
    with open(config_path + ".lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        with open(config_path) as f:
            text = amend(f.read(), directives, front_directives, unrouted)
        tmp = f"{config_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, config_path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--haproxy", required=True, help="the real HAProxy binary")
    parser.add_argument("--directive", action="append", default=[], help="one for the defaults section")
    parser.add_argument("--front-directive", action="append", default=[], help="one for the service's front")
    parser.add_argument("--unrouted-directive", action="append", default=[],
                        help="one for the answer to a path no application is routed at")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then HAProxy's arguments, as Ray gives them")
    ns = parser.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    if "-f" in args[:-1]:
        try:
            rewrite(args[args.index("-f") + 1], ns.directive, tuple(ns.front_directive),
                    tuple(ns.unrouted_directive))
        except (OSError, FrontConfigError) as exc:
            print(f"shortlist serve-ray: HAProxy not started: {exc}", file=sys.stderr)
            return 1
    os.execv(ns.haproxy, [ns.haproxy, *args])
    return 1  # not reached: execv replaces this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
