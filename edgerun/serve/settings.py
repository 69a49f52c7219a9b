"""The server's settings: one definition behind `edgerun serve`'s options, ServerConfig and deploy/edgerun.env.

Each `Setting` (edgerun/settings_table.py) names a ServerConfig field, its command-line flag, its EDGERUN_*
variable, its type, the help text, and the lines it gets in the env file the systemd unit reads. The settings
of loading a model (--model, --draft, --ctx, --rpc, ...) come from that module's table, which `edgerun
generate` and `chat` read too; the serve-only ones are written here. `click_options` turns them into
the CLI's options, `config_from_options` turns parsed options into a ServerConfig, and `render_env_file`
writes deploy/edgerun.env (a test keeps the committed file equal to it).
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import click

from ..cluster.rpc import cluster_options
from ..config import DEFAULT_MODEL
from ..errors import InvalidArgument
from ..settings_table import MODEL_SETTINGS, Setting, click_option

MiB = 1024 * 1024


@dataclass(frozen=True)
class ServerConfig:
    """What `edgerun serve` was asked to run. Every field but load_opts has a flag and an EDGERUN_* twin."""

    model: str = DEFAULT_MODEL
    draft: str | None = "auto"
    profile: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    max_per_client: int = 0              # requests one client may hold running + waiting (0: no cap)
    trusted_proxies: tuple[str, ...] = ()   # peers whose X-Forwarded-For names the client (serve/clients.py)
    queue: int = 8                       # requests allowed to wait behind the running ones
    parallel: int | None = None          # generations batched at once (None: the device profile's)
    prompt_cache_mib: int = 256          # RAM for finished sequences' KV caches (serve/promptcache.py); 0: off
    timeout_s: float = 300.0             # per-request limit: queue wait + generation
    stream_interval_ms: float = 20.0     # a streamed answer's tokens reach the socket at most this often
    max_body_bytes: int = 1 * MiB
    shutdown_grace_s: float = 10.0       # SIGTERM: how long the running generation may continue
    n_ctx: int | None = None
    n_threads: int | None = None
    gamma: int | str | None = None       # None/'auto': the tuner decides
    pull: bool = True                    # pull a registry model that is not cached yet
    insecure_no_auth: bool = False       # serve a non-loopback address without an API key, knowingly
    cors_origins: tuple[str, ...] = ()   # browser origins allowed to call the API (none by default)
    allowed_hosts: tuple[str, ...] = ()  # Host header names accepted besides the loopback ones
    rpc: tuple[str, ...] = ()            # RPC workers the target is split over (HOST:PORT)
    tensor_split: tuple = ()             # their shares (+ optionally the head's, last)
    require_gpu: bool = False            # refuse to serve unless the target's layers are all on a GPU
    ollama_port: int | None = None       # a second port for Ollama's clients (their default: 11434); None: none
    allow_pull: bool = False             # Ollama's /api/pull may download registry models to the cache
    ui: bool = True                      # the chat and status page at /
    suffix_history: int = 0              # tokens of earlier answers kept per API key for suffix drafts (0: off)
    load_opts: dict = field(default_factory=dict)   # further edgerun.load() options (tests, API users)

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise InvalidArgument(f"port must be an integer in 0..65535, got {self.port!r}")
        if self.ollama_port is not None and not (isinstance(self.ollama_port, int) and 1 <= self.ollama_port <= 65535
                                                 and self.ollama_port != self.port):
            raise InvalidArgument(f"ollama port must be an integer in 1..65535 other than --port, got {self.ollama_port!r}")
        if self.parallel is not None and not (isinstance(self.parallel, int) and 1 <= self.parallel <= 64):
            raise InvalidArgument(f"parallel must be an integer in 1..64 (generations at once), got {self.parallel!r}")
        if not isinstance(self.prompt_cache_mib, int) or self.prompt_cache_mib < 0:
            raise InvalidArgument(f"prompt cache must be an integer >= 0 MiB (0: off), got {self.prompt_cache_mib!r}")
        if not (isinstance(self.max_per_client, int) and self.max_per_client >= 0):
            raise InvalidArgument(f"max per client must be an integer >= 0 (0: no cap), got {self.max_per_client!r}")
        for p in self.trusted_proxies:
            try:
                ipaddress.ip_address(p.strip("[]"))
            except ValueError:
                raise InvalidArgument(f"--trusted-proxy {p!r:.60} is not an IP address") from None
        if not isinstance(self.queue, int) or self.queue < 0:
            raise InvalidArgument(f"queue must be an integer >= 0 (requests waiting), got {self.queue!r}")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise InvalidArgument(f"timeout must be a finite number of seconds > 0, got {self.timeout_s!r}")
        if not (isinstance(self.stream_interval_ms, (int, float)) and not isinstance(self.stream_interval_ms, bool)
                and 0 <= self.stream_interval_ms <= 1000):
            raise InvalidArgument(f"stream interval (--stream-interval) must be a number of milliseconds in 0..1000, "
                                  f"got {self.stream_interval_ms!r}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise InvalidArgument(f"max_body_bytes must be an integer >= 1024, got {self.max_body_bytes!r}")
        if not (self.shutdown_grace_s >= 0 and math.isfinite(self.shutdown_grace_s)):
            raise InvalidArgument(f"shutdown grace must be a finite number of seconds >= 0, got {self.shutdown_grace_s!r}")
        if not is_loopback(self.host) and self.api_key is None and not self.insecure_no_auth:
            raise InvalidArgument(
                f"--host {self.host} without an API key would let anyone who reaches this port use the model: "
                "set --api-key / EDGERUN_API_KEY, or pass --insecure-no-auth (EDGERUN_INSECURE_NO_AUTH=1) to "
                "accept that (a VPN or a firewall then has to keep strangers out)")
        for origin in self.cors_origins:
            if origin != "*" and not (origin.startswith(("http://", "https://")) and "/" not in origin.split("://", 1)[1]):
                raise InvalidArgument(f"--cors-origin {origin!r:.60} is not an origin; expected scheme://host[:port] "
                                      "such as http://192.168.1.20:3000 (or *)")
        cluster_options(self.rpc, self.tensor_split)     # here, so that `edgerun serve` fails before it binds
        if self.api_key is not None and not all(isinstance(k, str) and k.strip() for k in self.api_keys()):
            raise InvalidArgument("api_key must not be empty or white space (an empty --api-key= or EDGERUN_API_KEY= "
                                  "would silently mean no authentication; leave it unset to disable authentication)")
        if not (isinstance(self.suffix_history, int) and self.suffix_history >= 0):
            raise InvalidArgument(f"suffix history must be an integer >= 0 tokens per API key (0: off), "
                                  f"got {self.suffix_history!r}")

    def api_keys(self) -> tuple[str, ...]:
        """The accepted API keys: api_key is one key, or several (an --api-key-file of several lines)."""
        k = self.api_key
        return () if k is None else (k,) if isinstance(k, str) else tuple(k)


def is_loopback(host: str) -> bool:
    return host == "localhost" or is_loopback_address(host)


def is_loopback_address(host: str) -> bool:
    """Whether `host` is a loopback IP address written as one (127.0.0.0/8, ::1): a name that merely
    begins with "127." (127.0.0.1.attacker.example) is a DNS name like any other."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _csv(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in (value or "").split(",") if v.strip())


def _shared(name: str, **serve_side: Any) -> Setting:
    """A setting of the one table (edgerun/settings_table.py) with its env-file lines and ServerConfig mapping."""
    return replace(MODEL_SETTINGS[name], **serve_side)


SETTINGS: tuple[Setting, ...] = (
    _shared("model", env_value=DEFAULT_MODEL,
            env_doc=("Target model: a registry name (`edgerun list`), or a .gguf path the service can read",
                     "(ProtectHome=yes hides /home and /root: put local models under /opt or /var/lib).")),
    _shared("draft", env_value="auto",
            env_doc=("Drafter for speculative decoding: auto (the registry's pair, else suffix lookup), none,",
                     "suffix, lookup, or a model."),
            to_config=lambda v: None if v == "none" else v),
    _shared("gamma", env_value="auto",
            env_doc=("Draft length: auto (tuned from this board's measured costs) or an integer (0 = off).",)),
    _shared("profile_name", env_value="auto",
            env_doc=("Device profile: auto-detected unless named here (install.sh writes the detected one).",),
            field="profile"),
    Setting("host", ("--host",), "EDGERUN_HOST",
            "Address to bind. Anything but loopback exposes the API to the network: set an API key.",
            default="127.0.0.1", env_value="127.0.0.1",
            env_doc=("", "Network. 127.0.0.1 serves this board only; 0.0.0.0 exposes the API to the network:",
                     'set EDGERUN_API_KEY as well then (clients send "Authorization: Bearer <key>").')),
    Setting("port", ("--port",), "EDGERUN_PORT", "", type=click.IntRange(0, 65535), default=8080, env_value="8080"),
    Setting("api_key", ("--api-key",), "EDGERUN_API_KEY",
            "Require 'Authorization: Bearer KEY' on every endpoint but /health. A key on the command line is "
            "visible to every user in the process list: prefer --api-key-file or the variable.",
            env_example="change-me"),
    Setting("api_key_file", ("--api-key-file",), "EDGERUN_API_KEY_FILE",
            "Read the API key from this file, instead of --api-key; a file of several lines holds several keys "
            "(one per line), each a client of its own (--suffix-history keeps each key's answers apart).",
            type=click.Path(dir_okay=False), env_example="/etc/edgerun/api-key", field="api_key",
            to_config=lambda path: read_key_file(path) if path else None,
            env_doc=("Or keep the key in a file readable by root only (the unit reads it before dropping rights).",)),
    Setting("insecure_no_auth", ("--insecure-no-auth",), "EDGERUN_INSECURE_NO_AUTH",
            "DANGEROUS: serve a non-loopback --host without an API key (anyone who reaches the port can use "
            "the model). Refused otherwise.", is_flag=True, env_example="1",
            env_doc=("Only if the network itself keeps strangers out (a VPN): serve 0.0.0.0 without a key.",)),
    Setting("cors_origin", ("--cors-origin",), "EDGERUN_CORS_ORIGIN",
            "Browser origins (comma-separated, e.g. http://192.168.1.20:3000) allowed to call the API; "
            "requests from any other web page are refused (403).", env_example="http://192.168.1.20:3000",
            field="cors_origins", to_config=_csv,
            env_doc=("", "Browsers: web pages whose origin is listed here may call the API (comma-separated);",
                     "any other page gets 403, and a Host header that is not this board's loopback name",
                     "(DNS rebinding) gets 403 unless listed in EDGERUN_ALLOW_HOST.")),
    Setting("allow_host", ("--allow-host",), "EDGERUN_ALLOW_HOST",
            "Host header names accepted besides localhost/127.0.0.1/::1 when serving loopback (comma-separated).",
            env_example="edgerun.local", field="allowed_hosts", to_config=_csv),
    Setting("max_per_client", ("--max-per-client",), "EDGERUN_MAX_PER_CLIENT",
            "Requests one client may have running or waiting at once (more get 429); 0: no cap. Without a cap, "
            "a full queue still makes room for a client holding fewer requests than another. A client is its "
            "address; on loopback, the Unix user owning the connection.",
            type=click.IntRange(0, None), default=0, env_value="0",
            env_doc=("", "Fairness: requests one client may hold running + waiting (0: no cap; a full queue still",
                     "makes room for a client holding fewer than another). A client is its address; on loopback,",
                     "the Unix user owning the connection; behind a proxy listed in EDGERUN_TRUSTED_PROXY, the",
                     "address its X-Forwarded-For names.")),
    Setting("trusted_proxy", ("--trusted-proxy",), "EDGERUN_TRUSTED_PROXY",
            "Addresses of reverse proxies (comma-separated) whose X-Forwarded-For header names the client "
            "for the per-client cap. Any process that can connect from such an address can claim any client "
            "address: list only a proxy that is the sole way in.", env_example="127.0.0.1",
            field="trusted_proxies", to_config=_csv),
    Setting("parallel", ("--parallel",), "EDGERUN_PARALLEL",
            "Generations run at once, batched in one model context (continuous batching; each slot reserves "
            "--ctx positions of KV cache). Default: the device profile's.", type=click.IntRange(1, 64),
            env_example="4",
            env_doc=("", "Continuous batching: generations served at once (each reserves a context's KV cache);",
                     "empty: the device profile's (4 unless the profile says otherwise).")),
    Setting("prompt_cache_mib", ("--prompt-cache",), "EDGERUN_PROMPT_CACHE_MIB",
            "MiB of RAM for finished requests' KV caches: a later prompt that starts the same way (a system "
            "prompt, a retry, a conversation whose slot another client took) is restored instead of "
            "evaluated. 0 turns it off.", type=click.IntRange(0, None), default=256, env_value="256",
            env_doc=("", "Prompt cache: MiB of RAM for finished requests' KV caches, restored for a prompt that",
                     "starts the same way (0: off).")),
    Setting("queue", ("--queue",), "EDGERUN_QUEUE",
            "Requests allowed to wait behind the running ones; more get 503 + Retry-After.",
            type=click.IntRange(0, None), default=8, env_value="8",
            env_doc=("", "Load control: requests waiting behind the running ones (more get 503 + Retry-After),",
                     "per-request time limit in seconds, largest request body in KiB, and how long the",
                     "running generation may continue after `systemctl stop` before it is cancelled.")),
    Setting("timeout_s", ("--timeout",), "EDGERUN_TIMEOUT",
            "Server-side time limit per request in seconds (queue wait + generation).",
            type=click.FloatRange(0, None, min_open=True), default=300.0, env_value="300"),
    Setting("stream_interval_ms", ("--stream-interval",), "EDGERUN_STREAM_INTERVAL_MS",
            "Streaming: milliseconds between two writes of one answer's tokens at most; the tokens made in "
            "between go out together, each still its own SSE event. A held token waits for the next one, "
            "2 x the interval at most; 0 writes every token at once.", type=click.FloatRange(0, 1000),
            default=20.0, env_value="20",
            env_doc=("", "Streaming: a streamed answer's tokens are written at most every this many ms (the",
                     "tokens made in between go out together; 0: each at once).")),
    Setting("max_body_kb", ("--max-body",), "EDGERUN_MAX_BODY_KB", "Largest request body in KiB (413 above).",
            type=click.IntRange(1, None), default=1024, env_value="1024", field="max_body_bytes",
            to_config=lambda kib: kib * 1024),
    Setting("shutdown_grace", ("--shutdown-grace",), "EDGERUN_SHUTDOWN_GRACE",
            "On SIGTERM, seconds the running generation may continue before it is cancelled.",
            type=click.FloatRange(0, None), default=10.0, env_value="10", field="shutdown_grace_s"),
    _shared("n_ctx", env_example="4096", env_doc=("", "Engine overrides (empty: the device profile decides).")),
    _shared("n_threads", env_example="4"),
    _shared("rpc", env_example="127.0.0.1:50052,127.0.0.1:50053", to_config=_csv,
            env_doc=("", "A model split over several boards (docs/cluster.md): the workers' forwarded ports (one",
                     "edgerun-tunnel@HOST unit each) and, optionally, each one's share (+ this board's, last).")),
    _shared("tensor_split", env_example="1,1", to_config=_csv),
    _shared("no_pull", env_example="1", field="pull", to_config=lambda no: not no,
            env_doc=("", "Where models and probe results are cached. The unit points this at its CacheDirectory",
                     "(/var/cache/edgerun); uncomment only to use another place the service may write to.",
                     "#EDGERUN_HOME=/var/cache/edgerun",
                     "Fail at start instead of downloading a model that is not cached yet (air-gapped boards).")),
    _shared("require_gpu", env_example="1",
            env_doc=("", "GPU boards: fail at start instead of serving on the CPU when the model's layers did not",
                     "land on the GPU (a llama.cpp without CUDA, an unreachable device). docs/devices.md")),
    Setting("ollama_port", ("--ollama-port",), "EDGERUN_OLLAMA_PORT",
            "Also listen on this port (same --host, same API): Ollama's clients default to 11434. Ollama's API "
            "(/api/chat, /api/generate, ...) answers on --port as well.", type=click.IntRange(1, 65535),
            env_example="11434",
            env_doc=("", "Clients (docs/clients.md): Ollama's API answers beside OpenAI's; uncomment to listen on",
                     "Ollama's default port as well. /api/pull downloads registry models only with",
                     "EDGERUN_ALLOW_PULL=1. EDGERUN_NO_UI=1 turns off the chat and status page at /.")),
    Setting("allow_pull", ("--allow-pull",), "EDGERUN_ALLOW_PULL",
            "Let Ollama's /api/pull download registry models into the cache (refused otherwise: it writes to disk).",
            is_flag=True, env_example="1"),
    Setting("no_ui", ("--no-ui",), "EDGERUN_NO_UI", "Serve no chat and status page at /.", is_flag=True,
            env_example="1", field="ui", to_config=lambda no: not no),
    Setting("suffix_history", ("--suffix-history",), "EDGERUN_SUFFIX_HISTORY",
            "Tokens of earlier answers kept per API key (0: off) so that suffix drafts may copy from them: a "
            "repeated question is answered faster. Kept in RAM only (never on disk; ~14 MB per 100,000 tokens "
            "held), oldest dropped first; one key's answers never draft for another key. Drafts are verified, so "
            "answers do not change, but a client timing its answers could learn whether its text matched "
            "earlier answers of its own key: give clients who must not see each other their own keys.",
            type=click.IntRange(0, None), default=0, env_value="0",
            env_doc=("", "Suffix drafts from earlier answers (docs/free_drafts.md): tokens kept per API key in RAM",
                     "(0: off). Answers do not change; a key's timing may reveal matches with its own history.")),
)


def click_options(f: Callable) -> Callable:
    """Decorate a click command with every serve setting (flag, EDGERUN_* variable, default, help)."""
    for s in reversed(SETTINGS):
        f = click_option(s)(f)
    return f


def config_from_options(options: dict[str, Any], **extra: Any) -> ServerConfig:
    """A ServerConfig from the parsed serve options (the CLI function's keyword arguments). Two settings
    of one field (--api-key, --api-key-file) may not both be given."""
    values: dict[str, Any] = {}
    given: dict[str, str] = {}
    for s in SETTINGS:
        field_name, v = s.field or s.name, s.to_config(options[s.name])
        if field_name in given and v is not None and values.get(field_name) is not None:
            raise InvalidArgument(f"{given[field_name]} and {s.flags[0]} are both given; use one")
        if v is not None or field_name not in values:
            values[field_name] = v
            given[field_name] = s.flags[0]
    return ServerConfig(**values, **extra)


def read_key_file(path: str) -> str | tuple[str, ...]:
    """The API key in `path` (white space stripped), or its keys where it holds several lines (blank lines
    skipped)."""
    try:
        with open(path, encoding="utf-8") as f:
            keys = [line.strip() for line in f.read().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"cannot read the API key file {path}: {e}") from None
    if not keys:
        raise InvalidArgument(f"the API key file {path} is empty")
    return keys[0] if len(keys) == 1 else tuple(keys)


def render_env_file() -> str:
    """The text of deploy/edgerun.env: every setting's variable, with its documentation."""
    out = ["# /etc/edgerun/edgerun.env: settings of the edgerun service (systemd EnvironmentFile).",
           "# Each variable is the twin of an `edgerun serve` option (see `edgerun serve --help`).",
           "# After editing: sudo systemctl restart edgerun", ""]
    for s in SETTINGS:
        for line in s.env_doc:
            out.append(line if line == "" or line.startswith("#") else f"# {line}")
        out.append(f"{s.env}={s.env_value}" if s.env_value is not None else f"#{s.env}={s.env_example}")
    return "\n".join(out) + "\n"
