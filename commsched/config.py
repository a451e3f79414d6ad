"""Settings: filled once from init() arguments and COMMSCHED_* variables, validated at init()."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from fractions import Fraction
from typing import Any

from commsched.link_defaults import MAX_INLINE_BYTES

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0}
POLICIES = ("priority", "fifo")
TRANSPORTS = ("auto", "mpi", "gloo", "grpc", "nccl", "loopback")
DEVICES = ("auto", "cpu", "cuda")
LOG_LEVELS = ("trace", "debug", "info", "warning", "error")
CONTROL_CHANNELS = ("auto", "tcp", "transport")


# Sizes travel as unsigned 64-bit counts; anything near that is a typo, not a buffer.
MAX_SIZE_BYTES = 2**62


class SettingError(ValueError):
    """A setting's value is not in its accepted form."""


def parse_size(text: str | int) -> int:
    """Parses a whole byte count with an optional unit (4MiB, 1.5MiB, 512KB, 1048576)."""
    if isinstance(text, bool):
        raise TypeError("a size, not a boolean")
    if isinstance(text, int):
        if text < 0:
            raise ValueError("negative")
        size = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not match or match.group(2).lower() not in _SIZE_UNITS:
            raise ValueError("not a size")
        exact = Fraction(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]  # 0.1KB is exactly 100
        if exact.denominator != 1:
            raise ValueError(f"{float(exact):g} bytes is not a whole number of bytes")
        size = int(exact)
    if size > MAX_SIZE_BYTES:
        raise ValueError(f"{size} bytes is more than the largest size, 2**62 bytes")
    return size


def parse_duration(text: str | float) -> float:
    """Parses seconds with an optional unit (60, 60s, 500ms, 2min)."""
    if isinstance(text, bool):
        raise TypeError("a duration, not a boolean")
    if isinstance(text, (int, float)):
        if not math.isfinite(text):
            raise ValueError("not a finite number")  # nan compares false to every limit it is checked against
        if text < 0:
            raise ValueError("negative")
        return float(text)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _DURATION_UNITS:
        raise ValueError("not a duration")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).strip().lower()
        if text not in options:
            raise ValueError("not one of the options")
        return text

    return parse


def _device(value: Any) -> str:
    text = str(value).strip().lower()
    if text in DEVICES or re.fullmatch(r"cuda:\d+", text):
        return text
    raise ValueError("not a device")


def _path(value: Any) -> str:
    return str(value).strip()


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
        raise ValueError("not a switch")
    return text in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Settings:
    """The effective settings of one runtime."""

    policy: str = "priority"
    # Left unset, the three sizes are fitted to the link at init (default_sizes); these values
    # stand where no link is known (one rank, or gRPC / NCCL without COMMSCHED_LINK_*).
    partition_bytes: int = 4 * 1024**2
    credit_bytes: int | None = None  # None: one partition per rank, see credit_for()
    fusion_bytes: int = 1024**2
    # The torch plug-in's gradient buckets; None: one partition each across ranks (the gradients of
    # one bucket go as one collective), one bucket per dtype at one rank or without partitioning.
    bucket_bytes: int | None = None
    inline_bytes: int = 4096  # tensors up to this size ride in the agreement round (host memory)
    transport: str = "auto"
    device: str = (
        "auto"  # where the tensors live: cpu, cuda, cuda:N, or auto (the first submitted tensor decides)
    )
    timeline: str = ""
    stall_timeout: float = 60.0
    stall_shutdown: float = 300.0
    cycle_time: float = 0.001
    log_level: str = "warning"
    autotune: bool = False
    autotune_log: str = ""
    # The link the defaults are fitted to (default_sizes); None: measured at init under MPI.
    link_bandwidth: float | None = None  # bytes per second of each rank's link
    link_latency: float | None = None  # seconds per message
    # commsched's own host cost per collective (agreement, queueing, launch, completion): on a fast
    # link it puts a floor under partition and fusion (link_defaults.overhead_floor_bytes).
    collective_overhead: float = 20 * 1e-6  # 20us, the same float parse_duration("20us") gives
    # The transport's own fixed cost per large allreduce beyond its message latencies; None: measured
    # at init with the link where 1 MiB moves in under 2 ms (link_probe.probe_message_cost), else 0.
    link_message_cost: float | None = None
    # Pause between tests of collectives in flight; None: the transport's own, or on MPI half the link's
    # per-message latency when that is over 8 us, else none (polling.h: poll_interval_for).
    poll_interval: float | None = None
    # Where agreement rounds travel: tcp (connections of their own, marked low-delay, never behind data),
    # transport (the transport's own exchange), auto (tcp unless every rank shares one network stack).
    control_channel: str = "auto"
    control_address: str = ""  # the control channel's IPv4 address or interface; default: every address
    grpc_bind: str = ""  # gRPC transport: interface, IP or host to listen on; default reaches MASTER_ADDR
    grpc_bulk_bytes: int = 16 * 1024  # gRPC ring pieces this large go over a TCP/TLS socket; 0: all over gRPC
    # gRPC over TLS: all three files or none (see _check_grpc_tls); commsched-run --grpc-tls makes them.
    grpc_tls_ca: str = ""  # PEM: the CA every rank's certificate must chain to
    grpc_tls_cert: str = ""  # PEM: this rank's certificate, shown as server and as client
    grpc_tls_key: str = ""  # PEM: its private key
    grpc_tls_server_name: str = ""  # the name the servers' certificates carry, if not the address dialled

    def as_dict(self) -> dict[str, Any]:
        """The settings as a plain dict."""
        return asdict(self)

    def credit_for(self, ranks: int) -> int:
        """credit_bytes if given, else the default for this many ranks (see default_credit)."""
        if self.credit_bytes is not None:
            return self.credit_bytes
        return default_credit(self.partition_bytes, ranks)


_MIN_CREDIT_PARTITIONS = 2
_MAX_CREDIT_PARTITIONS = 16


def default_credit(partition_bytes: int, ranks: int) -> int:
    """The default credit: one partition per rank, at least 2 and at most 16 partitions.

    A ring allreduce on n ranks cuts each collective into n slices, so a message carries
    credit / n bytes of every collective in flight. Scaling the credit with n keeps about a
    partition on the wire per ring step, so each step's fixed latency is amortized as well at
    64 ranks as at 2; at 2 ranks two chunks are enough, and an urgent chunk queues behind less.
    """
    unit = partition_bytes or Settings.partition_bytes  # partitioning off: counted in default partitions
    return unit * min(_MAX_CREDIT_PARTITIONS, max(_MIN_CREDIT_PARTITIONS, ranks))


_RATE_UNITS = {
    "tbit": 1e12 / 8,
    "gbit": 1e9 / 8,
    "mbit": 1e6 / 8,
    "kbit": 1e3 / 8,
    "gbps": 1e9,
    "mbps": 1e6,
    "kbps": 1e3,
    "bps": 1.0,
    "bit": 1 / 8,
}


def parse_rate(text: str | float) -> float:
    """Parses a link rate in bytes per second (10gbit, 400mbit, 1.25GBps, 1.25GB/s, or a plain number)."""
    if isinstance(text, bool):
        raise TypeError("a rate, not a boolean")
    if isinstance(text, (int, float)):
        rate = float(text)
    else:
        lowered = str(text).strip().lower().replace("/s", "ps")
        match = re.fullmatch(r"(\d+(?:\.\d+)?(?:e[+-]?\d+)?)\s*([a-z]*)", lowered)
        if not match or match.group(2) not in _RATE_UNITS and match.group(2) != "":
            raise ValueError("not a rate")
        rate = float(match.group(1)) * (_RATE_UNITS[match.group(2)] if match.group(2) else 1.0)
    if not rate > 0 or rate == float("inf"):
        raise ValueError("a rate must be above 0")
    return rate


_SIZE_FORM = "a byte count with an optional unit, e.g. 4MiB, 512KB or 1048576"
_DURATION_FORM = "seconds with an optional unit, e.g. 60, 30s or 500ms"
# field -> (environment variable, parser, accepted form)
_SPECS: dict[str, tuple[str, Callable[[Any], Any], str]] = {
    "policy": ("COMMSCHED_POLICY", _choice(POLICIES), "one of " + ", ".join(POLICIES)),
    "partition_bytes": ("COMMSCHED_PARTITION_BYTES", parse_size, _SIZE_FORM + " (0 turns partitioning off)"),
    "credit_bytes": (
        "COMMSCHED_CREDIT_BYTES",
        parse_size,
        (
            "a byte count above 0 with an optional unit, e.g. 8MiB, 512KB or 8388608; or leave it unset: "
            "commsched then fits it to the link (measured, or COMMSCHED_LINK_BANDWIDTH and "
            "COMMSCHED_LINK_LATENCY), else takes one partition per rank, 2 to 16"
        ),
    ),
    "fusion_bytes": ("COMMSCHED_FUSION_BYTES", parse_size, _SIZE_FORM + " (0 turns fusion off)"),
    "bucket_bytes": (
        "COMMSCHED_BUCKET_BYTES",
        parse_size,
        _SIZE_FORM + " (unset: one partition; 0 sends each gradient as a collective of its own)",
    ),
    "inline_bytes": (
        "COMMSCHED_INLINE_BYTES",
        parse_size,
        _SIZE_FORM + " up to 64KiB (0 sends every tensor as a collective of its own)",
    ),
    "transport": ("COMMSCHED_TRANSPORT", _choice(TRANSPORTS), "one of " + ", ".join(TRANSPORTS)),
    "device": ("COMMSCHED_DEVICE", _device, "one of " + ", ".join(DEVICES) + ", cuda:N"),
    "timeline": ("COMMSCHED_TIMELINE", _path, "a file path for the Chrome trace"),
    "stall_timeout": ("COMMSCHED_STALL_TIMEOUT", parse_duration, _DURATION_FORM),
    "stall_shutdown": (
        "COMMSCHED_STALL_SHUTDOWN",
        parse_duration,
        _DURATION_FORM + " (0 never fails stalls)",
    ),
    "cycle_time": ("COMMSCHED_CYCLE_TIME", parse_duration, _DURATION_FORM),
    "log_level": ("COMMSCHED_LOG_LEVEL", _choice(LOG_LEVELS), "one of " + ", ".join(LOG_LEVELS)),
    "autotune": ("COMMSCHED_AUTOTUNE", _flag, "1 or 0 (also true/false, yes/no, on/off)"),
    "autotune_log": ("COMMSCHED_AUTOTUNE_LOG", _path, "a file path for the CSV log of trials"),
    "link_bandwidth": (
        "COMMSCHED_LINK_BANDWIDTH",
        parse_rate,
        "a rate per rank and direction, e.g. 10gbit, 400mbit or 1.25GBps (unset: measured at init under MPI)",
    ),
    "link_latency": (
        "COMMSCHED_LINK_LATENCY",
        parse_duration,
        _DURATION_FORM + " per message, e.g. 20us (unset: measured at init under MPI)",
    ),
    "collective_overhead": (
        "COMMSCHED_COLLECTIVE_OVERHEAD",
        parse_duration,
        _DURATION_FORM.replace("60, 30s or 500ms", "20us or 0.05ms")
        + " per collective (0: partitions and fusion follow the wire alone); commsched-bench schedule measures it",
    ),
    "link_message_cost": (
        "COMMSCHED_LINK_MESSAGE_COST",
        parse_duration,
        _DURATION_FORM.replace("60, 30s or 500ms", "0, 50us or 0.3ms")
        + " per large allreduce (unset: measured at init under MPI and Gloo on links that move 1 MiB in under 2ms)",
    ),
    "poll_interval": (
        "COMMSCHED_POLL_INTERVAL",
        parse_duration,
        "seconds with an optional unit, e.g. 20us, 0.1ms or 0"
        + " (unset: on MPI half the link's per-message latency when over 8us, else 0)",
    ),
    "control_channel": (
        "COMMSCHED_CONTROL_CHANNEL",
        _choice(CONTROL_CHANNELS),
        "one of " + ", ".join(CONTROL_CHANNELS),
    ),
    "control_address": (
        "COMMSCHED_CONTROL_ADDRESS",
        _path,
        "an IPv4 address or an interface name (eth0) of this host for the TCP control channel",
    ),
    "grpc_bind": ("COMMSCHED_GRPC_BIND", _path, "an interface name (eth0), an IP address or a host name"),
    "grpc_bulk_bytes": (
        "COMMSCHED_GRPC_BULK_BYTES",
        parse_size,
        _SIZE_FORM
        + ", the same on every rank (0 sends every piece over gRPC, for hosts open to the gRPC ports only)",
    ),
    "grpc_tls_ca": ("COMMSCHED_GRPC_TLS_CA", _path, "the path of a PEM file with the job's CA certificate"),
    "grpc_tls_cert": (
        "COMMSCHED_GRPC_TLS_CERT",
        _path,
        "the path of a PEM file with this rank's certificate",
    ),
    "grpc_tls_key": ("COMMSCHED_GRPC_TLS_KEY", _path, "the path of a PEM file with this rank's private key"),
    "grpc_tls_server_name": (
        "COMMSCHED_GRPC_TLS_SERVER_NAME",
        _path,
        "the host name the ranks' certificates carry (default: the address a rank dials)",
    ),
}
JOB_TOKEN_VARIABLE = "COMMSCHED_JOB_TOKEN"


def job_token(environ: dict[str, str] | None = None) -> str:
    """COMMSCHED_JOB_TOKEN, kept out of Settings so config() and logs never show it ("" if unset)."""
    environ = dict(os.environ) if environ is None else environ
    token = environ.get(JOB_TOKEN_VARIABLE, "").strip()
    if token and (len(token) < 8 or not token.isprintable()):
        raise SettingError(
            f"{JOB_TOKEN_VARIABLE} must be at least 8 printable characters, e.g. from `openssl rand -hex 16`"
        )
    return token


def resolve(arguments: dict[str, Any], environ: dict[str, str] | None = None) -> Settings:
    """Builds Settings from init() arguments, then COMMSCHED_* variables, then defaults."""
    environ = dict(os.environ) if environ is None else environ
    unknown = sorted(set(arguments) - set(_SPECS))
    if unknown:
        raise SettingError(
            f"commsched.init() got unknown setting(s) {', '.join(unknown)}; known settings: {', '.join(_SPECS)}"
        )
    values: dict[str, Any] = {}
    for field in fields(Settings):
        variable, parse, form = _SPECS[field.name]
        if arguments.get(field.name) is not None:
            raw, source = arguments[field.name], f"init({field.name}=...)"
        elif environ.get(variable, "").strip():
            raw, source = environ[variable], variable
        else:
            continue
        try:
            values[field.name] = parse(raw)
        except (ValueError, TypeError) as error:
            raise SettingError(f"{source}: {raw!r} is not valid ({error}); use {form}") from None
    settings = Settings(**values)
    _check_consistency(settings)
    return settings


def user_given(arguments: dict[str, Any], environ: dict[str, str] | None = None) -> frozenset[str]:
    """The settings given explicitly (init() argument or COMMSCHED_* variable), not defaulted."""
    environ = dict(os.environ) if environ is None else environ
    return frozenset(
        name
        for name, (variable, _, _) in _SPECS.items()
        if arguments.get(name) is not None or environ.get(variable, "").strip()
    )


def _check_consistency(settings: Settings) -> None:
    _check_grpc_tls(settings)
    if settings.credit_bytes == 0:
        raise SettingError("COMMSCHED_CREDIT_BYTES must be above 0; use a size such as 8MiB")
    if settings.inline_bytes > MAX_INLINE_BYTES:
        raise SettingError(
            f"COMMSCHED_INLINE_BYTES must be at most 64KiB, not {settings.inline_bytes}: every rank receives "
            "every rank's inline bytes; bigger tensors belong in a collective"
        )
    if settings.stall_timeout <= 0:
        raise SettingError("COMMSCHED_STALL_TIMEOUT must be above 0; use seconds such as 60")
    if settings.cycle_time <= 0 or settings.cycle_time > 1.0:
        raise SettingError("COMMSCHED_CYCLE_TIME must be above 0 and at most 1s; use e.g. 1ms")
    if settings.poll_interval is not None and settings.poll_interval > 0.01:
        raise SettingError(
            f"COMMSCHED_POLL_INTERVAL must be at most 10ms, not {settings.poll_interval}s: every collective is seen "
            "finished up to that late; use e.g. 20us, or leave it unset"
        )
    if settings.device.startswith("cuda") and settings.transport not in ("auto", "nccl", "mpi"):
        raise SettingError(
            f"COMMSCHED_DEVICE={settings.device} needs COMMSCHED_TRANSPORT=nccl, auto, or mpi (a CUDA-aware MPI), not "
            f"{settings.transport} (which moves host memory only)"
        )
    if settings.device == "cpu" and settings.transport == "nccl":
        raise SettingError(
            "COMMSCHED_TRANSPORT=nccl moves GPU memory only; use COMMSCHED_DEVICE=cuda or auto"
        )
    if settings.stall_shutdown and settings.stall_shutdown < settings.stall_timeout:
        raise SettingError(
            "COMMSCHED_STALL_SHUTDOWN must be 0 or at least COMMSCHED_STALL_TIMEOUT "
            f"({settings.stall_shutdown}s < {settings.stall_timeout}s)"
        )


def _check_grpc_tls(settings: Settings) -> None:
    """TLS for gRPC takes a CA, a certificate and a key, each a readable PEM file."""
    files = {
        "COMMSCHED_GRPC_TLS_CA": settings.grpc_tls_ca,
        "COMMSCHED_GRPC_TLS_CERT": settings.grpc_tls_cert,
        "COMMSCHED_GRPC_TLS_KEY": settings.grpc_tls_key,
    }
    given = [variable for variable, path in files.items() if path]
    if not given:
        if settings.grpc_tls_server_name:
            raise SettingError(
                "COMMSCHED_GRPC_TLS_SERVER_NAME is set but TLS is off; set COMMSCHED_GRPC_TLS_CA, _CERT and _KEY too"
            )
        return
    missing = [variable for variable in files if variable not in given]
    if missing:
        raise SettingError(
            f"{', '.join(given)} set but {', '.join(missing)} not: TLS for gRPC needs the CA, this rank's "
            "certificate and its key, as PEM files (commsched-run --grpc-tls makes a set for a local job)"
        )
    for variable, path in files.items():
        try:
            with open(path, "rb") as handle:
                head = handle.read(64 * 1024)
        except OSError as error:
            raise SettingError(
                f"{variable}={path!r} cannot be read ({error.strerror}); give a PEM file"
            ) from None
        if b"-----BEGIN " not in head:
            raise SettingError(f"{variable}={path!r} is not a PEM file (no -----BEGIN line); give a PEM file")


def timeline_path_for(path: str, rank: int, size: int) -> str:
    """The trace file of one rank: `{rank}` in the path is replaced; otherwise ranks above 0 get a suffix."""
    if not path:
        return ""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if size == 1 or rank == 0:
        return path
    stem, dot, extension = path.rpartition(".")
    return f"{stem}.rank{rank}.{extension}" if dot and "/" not in extension else f"{path}.rank{rank}"


# -- checkpointing: read by commsched.torch.Checkpointer when it is built, not by init() --
def _positive_int(value: Any) -> int:
    number = int(str(value).strip()) if not isinstance(value, bool) else -1
    if number < 1:
        raise ValueError("not a positive integer")
    return number


# argument -> (environment variable, parser, accepted form)
CHECKPOINT_SPECS: dict[str, tuple[str, Callable[[Any], Any], str]] = {
    "directory": ("COMMSCHED_CHECKPOINT_DIR", _path, "a directory path every rank can write to"),
    "keep": ("COMMSCHED_CHECKPOINT_KEEP", _positive_int, "a whole number of versions to keep, 1 or more"),
}
CHECKPOINT_DEFAULTS: dict[str, Any] = {"directory": "", "keep": 3}


def checkpoint_settings(arguments: dict[str, Any], environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Checkpointer options: arguments first, then the checkpoint variables of CHECKPOINT_SPECS, then defaults."""
    environ = dict(os.environ) if environ is None else environ
    values = dict(CHECKPOINT_DEFAULTS)
    for name, (variable, parse, form) in CHECKPOINT_SPECS.items():
        if arguments.get(name) is not None:
            raw, source = arguments[name], f"Checkpointer({name}=...)"
        elif environ.get(variable, "").strip():
            raw, source = environ[variable], variable
        else:
            continue
        try:
            values[name] = parse(raw)
        except (ValueError, TypeError):
            raise SettingError(f"{source}: {raw!r} is not valid; use {form}") from None
    if not values["directory"]:
        raise SettingError(
            "Checkpointer needs a directory: pass directory=... or set COMMSCHED_CHECKPOINT_DIR"
        )
    return values


# -- the torch plug-in's sharded optimizer: read by DistributedOptimizer when it is built --
def shard_setting(shard: bool | None, environ: dict[str, str] | None = None) -> bool:
    """DistributedOptimizer(shard=...) if given, else COMMSCHED_SHARD (default off)."""
    if shard is not None:
        if not isinstance(shard, bool):
            raise SettingError(f"DistributedOptimizer(shard=...): {shard!r} is not valid; use True or False")
        return shard
    environ = dict(os.environ) if environ is None else environ
    raw = environ.get("COMMSCHED_SHARD", "").strip()
    if not raw:
        return False
    try:
        return _flag(raw)
    except ValueError:
        raise SettingError(
            f"COMMSCHED_SHARD: {raw!r} is not valid; use 1 or 0 (also true/false, yes/no, on/off)"
        ) from None
