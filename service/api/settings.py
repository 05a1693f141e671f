"""Service settings: environment variables prefixed SHORTLIST_, overridden by `shortlist serve` flags."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from uvicorn.config import LOG_LEVELS

from service.api.cors import parse_origins
from service.engine.jsonlines import DEFAULT_MAX_LINE_CHARS, MAX_LINE_CHARS_RANGE
from service.engine.label_ledger import MAX_UID_CHARS
from service.engine.schema import MAX_MANIFEST_BYTES, BundleError, validate_version_name
from service.engine.small_files import RefusedFile, read_small_file
from service.engine.store import BundleStore
from service.engine.tree import MAX_BEAM

ENV_PREFIX = "SHORTLIST_"

# The fewest characters an admin token may have (SHORTLIST_ADMIN_TOKEN_MIN_CHARS may only raise it).
# The admin routes swap what every client is served and the image listens on all addresses: a
# short token is guessed, even at ADMIN_AUTH_FAILURES_PER_MINUTE from each of many addresses.
# 16 random hex characters hold 64 bits; the README generates 64.
ADMIN_TOKEN_MIN_CHARS = 16
# The most characters an admin token may have: a client sends it in one header line, which
# servers and proxies cap (ours: SHORTLIST_MAX_HEADER_BYTES); the token file is read no further.
ADMIN_TOKEN_MAX_CHARS = 4096
# Tokens printed in this project's examples (the README's `docker run` once used the first): a
# deployment copied from an example would publish its admin API with a token anyone can read.
ADMIN_TOKEN_PLACEHOLDERS = frozenset({"change-me"})


class SettingsError(ValueError):
    """Settings that cannot be used: one line per problem, each naming the SHORTLIST_* variable
    (or the command-line flag) that set it, never the value of a secret setting."""


# The most label slots one request may make the engine hold, texts x (k + excluded uids): it
# makes arrays of that size before anything is answered (SHORTLIST_MAX_K=10^12 let one
# {"k": 10^9} take 17.8 GB). 10^7: ~120 MB of ids and scores; the defaults need 140,800.
MAX_ANSWER_SLOTS = 10_000_000


class CrossCheck(ValueError):
    """A rule between settings: `reason` names each of `fields` as {field}, filled in with the
    variable or flag that set it when the problem is reported (load_settings)."""

    def __init__(self, fields: tuple[str, ...], reason: str) -> None:
        super().__init__(reason.format(**{f: f for f in fields}))
        self.fields, self.reason = fields, reason


class Settings(BaseSettings):
    # Empty variables count as unset, so `SHORTLIST_ADMIN_TOKEN=` (as compose passes an unset
    # variable) leaves the admin API off instead of enabling it with an empty token.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", env_ignore_empty=True)

    bundle_root: Path = Path("bundles")
    # None serves the newest bundle under the root.
    version: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)

    # Engine work runs in this many pool threads (each a concurrent engine call); the engine
    # itself runs each call with `engine_threads` intra-op threads. Both explicit so a 2-core
    # box is not oversubscribed by onnxruntime's default of one thread per core per session.
    workers: int = Field(2, ge=1, le=256)
    engine_threads: int = Field(1, ge=1, le=256)

    # Serving processes on one port (gunicorn's arbiter: a process that dies is restarted,
    # SIGTERM drains them all). More than one needs `state_dir`, where they agree on the active
    # version: an activation on any of them is followed by every other within
    # `process_sync_interval_s` and answered once all serve it (README "Several processes").
    processes: int = Field(1, ge=1, le=64)
    process_sync_interval_s: float = Field(0.2, ge=0.01, le=60.0)
    # How long an admin write waits for every other process to serve what it activated, past which
    # it answers 503 naming the processes that do not yet (the change stays recorded; they follow
    # when they can). A follower loads without a checking child: 5 s for a bundle of 10^6 labels on
    # a 2-core machine (bench/RESULTS.md, Scale), 60 s leaves room for a cold page cache and a busy host.
    process_converge_timeout_s: float = Field(60.0, gt=0.0, le=3600.0)
    # A process whose event loop has not reported to the arbiter for this long (stopped, or stuck
    # in a loop) is killed and replaced (gunicorn's worker timeout, whole seconds). The loop
    # reports every second and never waits for a load or a prediction (both run on threads):
    # only a stuck loop, or a host so overloaded a second's tick is a minute late, reaches it.
    process_stall_timeout_s: float = Field(60.0, ge=5.0, le=86_400.0)
    # With several processes, the arbiter loads the bundle they start with before forking them,
    # so its pages (the HNSW graphs included) are shared copy-on-write (service/api/supervisor.py).
    process_preload: bool = True

    # Dynamic batching of concurrent single-text requests: requests queue while every worker
    # is busy and leave together, up to batch_max_size; batch_max_wait_ms > 0 also holds a
    # lone request that long hoping for company (costs latency at low load).
    batching: bool = True
    batch_max_size: int = Field(32, ge=1, le=4096)
    batch_max_wait_ms: float = Field(0.0, ge=0.0, le=1000.0)
    # The line in front of each process's engine (service/api/batching.py): a prediction that would have to
    # wait while max_queued_texts texts already wait, or that waited max_queue_wait_ms before its
    # engine call could start, gets 503 `overloaded` with Retry-After, so a flood is refused at
    # once instead of answered tens of seconds late. Texts, not requests: a 128-text batch costs
    # ~128 single texts. Defaults far above normal load: 16 connections of 128-text batches (the
    # benchmarks') queue at most 2,048 texts, and their longest wait on the heaviest route
    # (tree, beam 256: 0.2 s a call) is ~1.5 s.
    max_queued_texts: int = Field(4096, ge=1, le=10_000_000)
    max_queue_wait_ms: float = Field(10_000.0, ge=1.0, le=3_600_000.0)

    # Writable directory for what must survive a restart (the bundle root may be read-only):
    # the active version, recorded at every activation and rollback and served after a
    # restart. None: not remembered (start-up serves `version`, else the newest bundle).
    state_dir: Path | None = None

    # Request limits.
    # Upper bounds: far past any real use, below what one request could make the process allocate
    # before anything refuses it (SHORTLIST_MAX_K=10^12 let {"k": 10^9} take 17.8 GB).
    max_text_chars: int = Field(2000, ge=1, le=16_777_216)
    # What the tokenizer reads is the text after NFKC normalisation, which makes a character up to
    # 18 (U+FDFA): a text must also be at most this long in that form (None: 2 x max_text_chars;
    # ordinary text grows little, 2,000 ligatures "ﬁ" make 4,000).
    max_normalized_chars: int | None = Field(None, ge=1, le=1 << 28)
    max_k: int = Field(100, ge=1, le=100_000)
    max_batch: int = Field(128, ge=1, le=65_536)
    max_body_bytes: int = Field(1_048_576, ge=64, le=1 << 30)
    max_beam: int = Field(256, ge=1, le=MAX_BEAM)  # the engine's widest beam
    max_exclude: int = Field(1000, ge=0, le=1_000_000)
    # The most bytes of a bundle's manifest.json read (listing, activation, start-up): past it the
    # bundle is refused, naming the file (service.engine.small_files).
    max_manifest_bytes: int = Field(MAX_MANIFEST_BYTES, ge=1024, le=1 << 30)
    # The longest line of a data or label file the offline commands read (service/engine/jsonlines.py,
    # which reads the variable itself: the engine does not import these settings). A field here too
    # because `labels add` and `serve` load every setting: as an unknown variable it stopped both,
    # though the README tells users to set it; a bad value is refused as the data commands refuse it.
    max_line_chars: int = Field(DEFAULT_MAX_LINE_CHARS, ge=MAX_LINE_CHARS_RANGE[0], le=MAX_LINE_CHARS_RANGE[1])

    # What a client may hold before (and while) its request reaches the app (service/api/
    # http_protocol.py, request_body.py). Connections past max_connections get a 503 and are
    # closed (each open socket holds a file descriptor); a request head (request line and
    # headers) must arrive within header_timeout_s of its first byte (of the connection, for a
    # new one: a socket that never sends is closed) and within max_header_bytes (431 past it,
    # refused before it is buffered); a body must arrive within body_timeout_s of its head
    # (408). Idle keep-alive connections close after keep_alive_timeout_s. A client that reads
    # nothing of an answer waiting to be sent (past the socket's buffer) for send_timeout_s is
    # disconnected (499), with any requests it pipelined behind: it held the answer's memory.
    max_connections: int = Field(1000, ge=1, le=1_000_000)
    header_timeout_s: float = Field(10.0, gt=0.0, le=3600.0)
    max_header_bytes: int = Field(32_768, ge=1024, le=16_777_216)
    body_timeout_s: float = Field(30.0, gt=0.0, le=3600.0)
    send_timeout_s: float = Field(30.0, gt=0.0, le=3600.0)
    keep_alive_timeout_s: float = Field(5.0, gt=0.0, le=3600.0)
    # Proxies whose X-Forwarded-For / X-Forwarded-Proto the service believes (comma-separated
    # addresses or networks, or "*"): the client address they give is the one the admin
    # auth-failure limit counts and the access log names. None by default: uvicorn's own default
    # trusts loopback, so any client whose connection came through a local tunnel or port-forward
    # chose the address the limit counted.
    forwarded_allow_ips: str = ""
    # Browser pages on these origins may call the API (comma-separated scheme://host[:port], or *;
    # service.api.cors). Empty: no CORS headers, so a page elsewhere cannot read an answer.
    cors_origins: str = ""

    # Admin API: off unless a token is set (the variable, or the file admin_token_file names,
    # e.g. a Docker or compose secret: a variable's value shows in `docker inspect`; the file is
    # read at start-up, its trailing newline dropped); optionally on its own port.
    admin_token: SecretStr | None = None
    admin_token_file: Path | None = None
    admin_token_min_chars: int = Field(ADMIN_TOKEN_MIN_CHARS, ge=ADMIN_TOKEN_MIN_CHARS, le=ADMIN_TOKEN_MAX_CHARS)
    admin_host: str | None = None
    admin_port: int | None = Field(None, ge=0, le=65535)
    # Quality gate at activation, on the bundle's stored validation rows: P@1 (percent) must
    # reach this floor. None disables the gate.
    quality_gate_min_p1: float | None = Field(None, ge=0.0, le=100.0)
    # Wrong admin tokens a client (by address) may send per minute before its admin requests get
    # 429 for the rest of the minute: token guessing is slowed to this rate.
    admin_auth_failures_per_minute: int = Field(10, ge=1, le=100_000)
    # Label changes (POST /admin/labels, DELETE /admin/labels/{uid}; service/engine/label_changes.py),
    # which need state_dir to write the bundles they make: labels (or uids) per request,
    # characters of a uid, changes applied per minute (each a new version; past it 429 with
    # Retry-After) and
    # changes waiting for the one before them (past it 429): a change once accepted is applied.
    max_label_batch: int = Field(1000, ge=1, le=100_000)
    max_uid_chars: int = Field(256, ge=1, le=MAX_UID_CHARS)
    label_changes_per_minute: int = Field(120, ge=1, le=100_000)
    max_pending_label_changes: int = Field(64, ge=1, le=10_000)
    # How long an activation or rollback waits for the activation lock held by a label change (or
    # another process's start-up or follow) before it answers 503 naming it, with Retry-After.
    # Label changes still queued let it go first, so it waits for the one in progress: ~1 s at 572
    # labels, 26 s adding 1,000 labels to 10^5 (bench/RESULTS.md "Labels added live"). 0: never waits.
    activation_lock_wait_s: float = Field(60.0, ge=0.0, le=3600.0)
    # Derived versions kept in STATE_DIR/bundles: after each activation the oldest beyond this many
    # are removed, unless one is active, in the rollback history or served by a process sharing the
    # state directory (README "Labels added live": disk use).
    keep_derived_versions: int = Field(16, ge=0, le=10_000)
    # Bundles one GET /admin/bundles answer lists at most (its `limit`'s default and ceiling; past
    # them `next_offset` pages on). Each row carries its manifest's metrics (a manifest is read up to
    # MAX_MANIFEST_BYTES), and a bundle root kept for months holds hundreds of versions: unpaged, an
    # answer grew with every version (2.1 MB at 1,000 versions of a small bundle; audit s25 F2).
    max_listed_bundles: int = Field(1000, ge=1, le=100_000)
    # Platform tricks for hot swaps beside live traffic, both off by default (bench/swap.py
    # measures what they buy; README "Hot swap"). loader_nice: bundle loads (startup,
    # activation, rollback) run on threads this much nicer than the serving threads (0..19),
    # so a swap takes CPU from idle time first. heap_tuning: glibc's heap is set to one arena,
    # no per-block mmap and explicit trimming, and loads pre-fault the memory hnswlib copies an
    # index into with the GIL released (service/engine/heap.py); otherwise that copy
    # page-faults with the GIL held, stalling requests in flight.
    loader_nice: int = Field(0, ge=0, le=19)
    heap_tuning: bool = False
    # On Linux, the memory hnswlib copies an HNSW index into is given transparent huge pages
    # (service/engine/heap.py): its searches stop missing the TLB on nearly every vector read.
    # On by default where it applies (a bundle that searches an index of 4 MiB or more; bench/
    # RESULTS.md, issue 22); false leaves the kernel's default pages.
    huge_pages: bool = True
    # Every bundle is first loaded, and its canaries answered, in a child process (service/engine/
    # isolated.py): native code that crashes or hangs on a bundle that passed every structural
    # check takes down that child, and the bundle is refused, instead of the serving process.
    # Costs the child's start-up and one more load per activation (README "Faults").
    load_check_in_child: bool = True
    load_check_timeout_s: float = Field(600.0, gt=0.0, le=86_400.0)
    # How long a retired bundle may wait for in-flight requests before it is closed anyway.
    drain_timeout_s: float = Field(30.0, ge=0.0, le=86_400.0)
    # `serve-ray` only: how long a prediction waits for every shard's answer (a shard replica that
    # died is replaced in ~10 s, during which Serve holds calls to it) before it is answered 503
    # shard_unavailable with Retry-After (service/api/ray_app.py).
    shard_timeout_s: float = Field(5.0, gt=0.0, le=600.0)
    # How often the serving version's files are compared with what was loaded (size, mtime,
    # inode: ~20 stats); a file written in place turns predictions into 503 `bundle_changed`
    # until a version is activated (README "Faults"). 0: only the checks on the request path.
    bundle_check_interval_s: float = Field(1.0, ge=0.0, le=3600.0)

    # Diagnostics: a trivial echo route (the framework's floor in bench/http_bench.py) and a route
    # that raises (to exercise the 500 path in tests). Both off by default.
    echo_route: bool = False
    fault_route: bool = False
    access_log: bool = True
    # uvicorn's levels (trace below debug), in any case. Checked here: an unknown one was a
    # traceback from uvicorn (exit 1; exit 3 with several processes) or a line naming no setting.
    log_level: str = "info"

    @model_validator(mode="after")
    def _processes_need_state(self) -> Settings:
        if self.processes > 1 and self.state_dir is None:
            raise CrossCheck(("processes", "state_dir"), f"{{processes}}={self.processes} needs {{state_dir}}: "
                             "the processes agree on the active version there")
        if self.processes > 1 and self.admin_port is not None:
            raise CrossCheck(("processes", "admin_port"), f"{{processes}}={self.processes} needs {{admin_port}} "
                             "unset: more than one process serves the admin routes on the main port")
        return self

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _addresses_or_networks(cls, value: str) -> str:
        entries = [e.strip() for e in value.split(",") if e.strip()]
        for entry in entries:
            if entry == "*":
                continue
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(f"{entry!r} is not an IP address, a network (10.0.0.0/8) nor *") from None
        return ",".join(entries)

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, value: str) -> str:
        return parse_origins(value)

    @field_validator("log_level", mode="before")
    @classmethod
    def _a_log_level(cls, level: Any) -> Any:
        if not isinstance(level, str) or level.strip().lower() not in LOG_LEVELS:
            raise ValueError(f"not a log level: use one of {', '.join(LOG_LEVELS)}")
        return level.strip().lower()

    @field_validator("host", "admin_host")
    @classmethod
    def _host_serve_can_bind(cls, host: str | None) -> str | None:
        # Checked here, so that a host serve cannot bind stops start-up as a setting (exit 2),
        # not after the bundle loaded (exit 3; audit s14 L7).
        return None if host is None else bindable_host(host)

    @field_validator("version")
    @classmethod
    def _version_is_a_version_name(cls, version: str | None) -> str | None:
        # A name that cannot be a bundle's (`../x`) is configuration, refused here: start-up's
        # fallback to the newest bundle is for a version that exists in name but cannot be served.
        try:
            return None if version is None else validate_version_name(version)
        except BundleError as exc:
            raise ValueError(str(exc).replace(f" {version!r}", "", 1)) from None

    @model_validator(mode="after")
    def _admin_port_of_its_own(self) -> Settings:
        # Two servers cannot listen on one address and port: uvicorn would stop after start-up
        # with "address already in use". Port 0 picks a free port for each.
        if self.admin_port and self.admin_port == self.port and _same_address(self.admin_host or self.host, self.host):
            raise CrossCheck(("admin_port", "port"), f"{{admin_port}}={self.admin_port} equals {{port}}: the admin "
                             "routes need a port of their own (unset it to serve them on the main port)")
        return self

    @model_validator(mode="after")
    def _admin_token_usable(self) -> Settings:
        if self.admin_token_file is not None:
            if self.admin_token is not None:
                raise CrossCheck(("admin_token", "admin_token_file"),
                                 "{admin_token} and {admin_token_file} are both set: set one")
            self.admin_token = SecretStr(_read_token_file(self.admin_token_file))
        if self.admin_token is not None:
            _check_admin_token(self.admin_token.get_secret_value(),
                               "admin_token_file" if self.admin_token_file is not None else "admin_token",
                               self.admin_token_min_chars)
        return self

    @model_validator(mode="after")
    def _normalized_at_least_raw(self) -> Settings:
        if self.max_normalized_chars is not None and self.max_normalized_chars < self.max_text_chars:
            raise CrossCheck(("max_normalized_chars", "max_text_chars"),
                             f"{{max_normalized_chars}}={self.max_normalized_chars} is below {{max_text_chars}}="
                             f"{self.max_text_chars}: ASCII texts the text limit takes would be refused")
        return self

    @model_validator(mode="after")
    def _an_answer_is_bounded(self) -> Settings:
        slots = self.max_batch * (self.max_k + self.max_exclude)
        if slots > MAX_ANSWER_SLOTS:
            raise CrossCheck(("max_batch", "max_k", "max_exclude"),
                             f"{{max_batch}} x ({{max_k}} + {{max_exclude}}) = {slots:,} label slots one request may "
                             f"make the engine hold, past {MAX_ANSWER_SLOTS:,}: lower one of them")
        return self

    @model_validator(mode="after")
    def _a_full_batch_can_wait(self) -> Settings:
        if self.max_queued_texts < self.max_batch:
            raise CrossCheck(("max_queued_texts", "max_batch"),
                             f"{{max_queued_texts}}={self.max_queued_texts} is below {{max_batch}}={self.max_batch}: "
                             "a batch the request limit takes could never wait for the engine")
        return self

    @property
    def normalized_text_limit(self) -> int:
        """Characters a text may have after normalisation (max_normalized_chars, resolved)."""
        return self.max_normalized_chars if self.max_normalized_chars is not None else 2 * self.max_text_chars

    def environment(self) -> dict[str, str]:
        """These settings as SHORTLIST_* variables, from which another process builds the same Settings."""
        env = {}
        for name, value in self.model_dump().items():
            # A token read from a file stays there: each process reads the file itself.
            if value is None or (name == "admin_token" and self.admin_token_file is not None):
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            env[f"SHORTLIST_{name.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
        return env

    @model_validator(mode="after")
    def _no_unknown_variables(self) -> Settings:
        # pydantic-settings ignores prefixed variables that match no field: a misspelt limit
        # (or one a release removed) would silently fall back to its default.
        prefix = ENV_PREFIX
        unknown = sorted(name for name in os.environ
                         if name.upper().startswith(prefix)
                         and name[len(prefix):].lower() not in type(self).model_fields)
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)}: not one of "
                             f"{', '.join(prefix + f.upper() for f in type(self).model_fields)}")
        return self


def _same_address(a: str, b: str) -> bool:
    """Whether servers on hosts `a` and `b` would both take a port's one address (a wildcard takes every one).
    Names are compared by the addresses they resolve to: "localhost" and "127.0.0.1" clash."""
    wildcards = ("", "0.0.0.0", "::")
    if a == b or a in wildcards or b in wildcards:
        return True
    return bool(_addresses(a) & _addresses(b))


def _addresses(host: str) -> set[str]:
    # bindable_host has checked that the host resolves; a name that stops resolving in between
    # shares no address here, and serve then reports what the bind says.
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return set()
    return {str(ipaddress.ip_address(info[4][0].split("%")[0])) for info in infos}


def bindable_host(host: str) -> str:
    """`host` as serve binds it: an IP address (an IPv6 one also in its URL form `[::1]`, which
    is unbracketed), a name that resolves now, or "" (every address). Raises ValueError saying why not."""
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        address = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        address = None
    if bracketed:
        if not isinstance(address, ipaddress.IPv6Address):
            raise ValueError("brackets hold an IPv6 address only, e.g. [::1]")
        return str(address)
    if address is not None or host == "":
        return host
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise ValueError(f"not an IP address nor a name that resolves ({getattr(exc, 'strerror', None) or exc}): "
                         "serve could not listen on it") from None
    return host


def _read_token_file(path: Path) -> str:
    # A regular file (symlinks followed: Kubernetes secrets are links), opened so that a FIFO
    # cannot block start-up, and read no further than a token may be long (+2 for a line end):
    # /dev/zero or a huge file are refused, not read into memory (audit s14 L2).
    try:
        token = read_small_file(path, ADMIN_TOKEN_MAX_CHARS + 2, follow_symlinks=True).decode("utf-8")
    except (OSError, RefusedFile, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).removeprefix(f"{path}: ")
        raise CrossCheck(("admin_token_file",), f"{{admin_token_file}}={_braces(str(path))}: cannot be read: "
                         f"{_braces(reason.lower())}") from None
    # `echo TOKEN > file` and editors end the file with a newline, which no client sends.
    return token.removesuffix("\n").removesuffix("\r")


def _unsendable(token: str) -> str | None:
    """Why a client's `Authorization: Bearer` header cannot carry `token` (None when it can): the
    first character that is not visible ASCII, by its position and code point, never the token.
    (RFC 6750's b64token is a subset of visible ASCII; tokens accepted before stay valid.)"""
    for position, char in enumerate(token, 1):
        if not "!" <= char <= "~":
            name = " (a byte order mark)" if char == "\ufeff" else ""
            return f"U+{ord(char):04X}{name} at character {position}"
    return None


def _check_admin_token(token: str, source: str, min_chars: int) -> None:
    """Refuse a token a client cannot send or anyone could guess; `source` names the setting that
    gave it, and no message holds the token."""
    advice = "generate one, e.g. `openssl rand -hex 32`"
    token_of = f"{{{source}}}" if source == "admin_token" else f"the token in {{{source}}}"
    if token in ADMIN_TOKEN_PLACEHOLDERS:
        raise CrossCheck((source,), f"{token_of} is the placeholder of an example: {advice}")
    if len(token) < min_chars:
        raise CrossCheck((source, "admin_token_min_chars"), f"{token_of} is shorter than "
                         f"{{admin_token_min_chars}}={min_chars} characters: {advice}")
    if token != token.strip():
        raise CrossCheck((source,), f"{token_of} starts or ends with white space, which a client's "
                         "Authorization header cannot carry")
    if len(token) > ADMIN_TOKEN_MAX_CHARS:
        raise CrossCheck((source,), f"{token_of} is longer than {ADMIN_TOKEN_MAX_CHARS} characters: {advice}")
    if (where := _unsendable(token)) is not None:
        raise CrossCheck((source,), f"{token_of} holds {where}: a client's Authorization header carries visible "
                         f"ASCII only: {advice}")


def _braces(text: str) -> str:
    """`text` as literal text in a CrossCheck reason (which is formatted with the settings' names)."""
    return text.replace("{", "{{").replace("}", "}}")


def secret_fields() -> frozenset[str]:
    """Settings whose values are secrets (typed SecretStr): never shown in any message."""
    return frozenset(name for name, field in Settings.model_fields.items() if "SecretStr" in str(field.annotation))


def variable_name(field: str) -> str:
    return f"{ENV_PREFIX}{field.upper()}"


def load_settings(flags: dict[str, tuple[str, Any]] | None = None) -> Settings:
    """Settings from the environment, with `flags` (field -> (flag, value), e.g. "port" ->
    ("--port", 99999)) winning. Every way the service builds its Settings goes through here, so
    that an error is a SettingsError naming SHORTLIST_* variables and flags, not pydantic's
    report, which names fields and prints the inputs, the admin token among them."""
    flags = flags or {}
    try:
        return Settings(**{field: value for field, (_, value) in flags.items()})
    except ValidationError as exc:
        problems = [_problem(error, flags) for error in exc.errors(include_input=False, include_url=False)]
        # `from None`: the chained ValidationError, printed by any traceback, would show the inputs.
        raise SettingsError(_without_secrets("\n".join(problems), flags)) from None


def environment_setting(field: str) -> Any:
    """One setting as the environment sets it (its default when unset or empty), checked as
    load_settings checks it, a SettingsError naming the variable otherwise: for an offline
    command that reads this one setting and must not refuse over other variables it does not use
    (`shortlist eval` counts the texts past MAX_TEXT_CHARS). Cross-checks between settings are not
    made (they need the others)."""
    info = Settings.model_fields[field]
    raw = _environment_value(variable_name(field))
    if not raw:
        return info.get_default(call_default_factory=True)
    try:
        return TypeAdapter(Annotated[info.annotation, info]).validate_python(raw)
    except ValidationError as exc:
        errors = exc.errors(include_input=False, include_url=False)
        raise SettingsError("\n".join(_problem({**error, "loc": (field,)}, {}) for error in errors)) from None


def environment_text_limits() -> Settings:
    """Settings holding MAX_TEXT_CHARS and MAX_NORMALIZED_CHARS as this environment sets them
    (the rest defaults), each checked as environment_setting checks it and the two checked
    against each other as load_settings checks them: what `shortlist eval` needs to tell which
    texts the API would refuse, refused where `serve` would refuse it."""
    fields = ("max_text_chars", "max_normalized_chars")
    settings = Settings.model_construct(**{field: environment_setting(field) for field in fields})
    try:
        settings._normalized_at_least_raw()
    except CrossCheck as exc:
        raise SettingsError(exc.reason.format(**{field: variable_name(field) for field in exc.fields})) from None
    return settings


def offline_store(root: str | Path) -> BundleStore:
    """The places a server of this environment would read beside the bundle root `root`: `root`
    and the state directory (SHORTLIST_STATE_DIR; none when unset). An offline command writing
    a bundle into `root` gives it no version name either holds (BundleStore.check_free): the
    state directory's versions are the server's label changes, which its record and rollback
    history name."""
    return BundleStore(root, environment_setting("state_dir"))


def _problem(error: Any, flags: dict[str, tuple[str, Any]]) -> str:
    """One line: what set the setting (variable or flag, with its value unless secret) and why."""
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, CrossCheck):
        return cause.reason.format(**{f: _source(f, flags) for f in cause.fields})
    message = error["msg"].removeprefix("Value error, ")
    message = message[:1].lower() + message[1:]
    if not error["loc"]:
        return message
    field = str(error["loc"][0])
    if field in secret_fields():
        return f"{_source(field, flags)}: {message}"
    if field in flags:
        return f"{flags[field][0]} {_shorten(str(flags[field][1]))}: {message}"
    value = _environment_value(variable_name(field))
    return f"{variable_name(field)}{'' if value is None else '=' + repr(_shorten(value))}: {message}"


def _source(field: str, flags: dict[str, tuple[str, Any]]) -> str:
    return flags[field][0] if field in flags else variable_name(field)


def _shorten(value: str, limit: int = 80) -> str:
    return value if len(value) <= limit else value[:limit] + "..."


def _environment_value(name: str) -> str | None:
    # pydantic-settings reads variable names in any case.
    return next((value for key, value in os.environ.items() if key.upper() == name), None)


def _without_secrets(text: str, flags: dict[str, tuple[str, Any]]) -> str:
    """`text` with every secret setting's value masked: a second guard, should a message of
    pydantic's (not ours) ever quote an input."""
    for field in secret_fields():
        value = flags[field][1] if field in flags else _environment_value(variable_name(field))
        value = value.get_secret_value() if isinstance(value, SecretStr) else value
        # A shorter token is refused (_check_admin_token) and never in use; masking its few
        # characters wherever they occur would garble the message that refuses it.
        if value and len(str(value)) >= ADMIN_TOKEN_MIN_CHARS:
            text = text.replace(str(value), "***")
    return text
