"""Settings: filled once from init() arguments and COMMSCHED_* variables, validated at init()."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from fractions import Fraction
from typing import Any

from commsched import collective_model

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


@dataclass(frozen=True)
class DefaultRule:
    """Partition, credit and fusion sizes as a function of the link's ring delay (see default_sizes).

    Partition and credit are each `scale x (delay / 1 MiB) ** exponent`, rounded to a power of two;
    the constants are fitted by benchmarks/choose_defaults.py with the simulator over rank counts,
    bandwidths and latencies (docs/data/default_rule.json holds the fit and its table).
    """

    partition_scale_bytes: float
    partition_exponent: float
    min_partition_bytes: int
    max_partition_bytes: int
    credit_scale_bytes: float
    credit_exponent: float
    min_credit_partitions: int
    max_credit_partitions: int
    fusion_bytes: int


# Fitted by `python benchmarks/choose_defaults.py --credit-only --json docs/data/default_rule.json`
# with agreement rounds on the control channel, as they run across hosts: the credit is about the
# link's delay bytes, within 1.24x (1.02x geometric mean) of each case's best grid setting over
# 2-1024 ranks, 1-100 Gbit/s, 2-50 us; the partition and fusion are ROUNDS_ON_DATA_RULE's.
DEFAULT_RULE = DefaultRule(
    partition_scale_bytes=4 * 1024**2,
    partition_exponent=0.25,
    min_partition_bytes=256 * 1024,
    max_partition_bytes=64 * 1024**2,
    credit_scale_bytes=1024**2,
    credit_exponent=1.0,
    min_credit_partitions=4,
    max_credit_partitions=64,
    fusion_bytes=4 * 1024**2,
)
# The rule fitted before rounds could leave the data's path in the simulator (choose_defaults.py with
# rounds queued behind the data, as --rounds data runs; at most 1.17x, 1.03x on geometric mean), for
# rounds in the transport's own connection (COMMSCHED_CONTROL_CHANNEL=transport): each round queues
# behind the bytes in flight, so credit comes back late and 8 x the delay keeps the link busy.
# Links with under ~2.5 MiB of delay (the 2-4-rank rig's) get the same sizes from both rules.
ROUNDS_ON_DATA_RULE = dataclasses.replace(DEFAULT_RULE, credit_scale_bytes=8 * 1024**2)
ROUNDS = ("channel", "data")
_DELAY_UNIT_BYTES = 1024**2


def ring_delay_bytes(ranks: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Bytes the link could move while one ring allreduce pays its 2(n-1) message latencies."""
    return bandwidth_bytes_per_s * 2 * max(1, ranks - 1) * latency_s


def link_delay_bytes(
    ranks: int, bandwidth_bytes_per_s: float, latency_s: float, algorithm: str = "ring"
) -> float:
    """Bytes the link could move while one allreduce under a concrete `algorithm` pays its message
    latencies (collective_model.steps): ring_delay_bytes for the ring."""
    return bandwidth_bytes_per_s * collective_model.steps(algorithm, max(2, ranks)) * latency_s


def _power_of_two(value: float, low: int, high: int) -> int:
    """`value` rounded to the nearest power of two (in log scale), within [low, high]."""
    if not value > 0:
        return low
    return int(min(high, max(low, 2 ** round(math.log2(value)))))


def _scaled(scale_bytes: float, exponent: float, delay_bytes: float) -> float:
    """scale x (delay / 1 MiB) ** exponent: a constant at exponent 0, 0 for no delay otherwise."""
    if exponent == 0:
        return scale_bytes
    return scale_bytes * (max(delay_bytes, 0.0) / _DELAY_UNIT_BYTES) ** exponent


def _sizes_for_delay(delay: float, rule: DefaultRule, partition_bytes: int | None) -> dict[str, int]:
    """The rule's partition, credit and fusion for a link whose collectives wait `delay` bytes' time."""
    partition = _power_of_two(
        _scaled(rule.partition_scale_bytes, rule.partition_exponent, delay),
        rule.min_partition_bytes,
        rule.max_partition_bytes,
    )
    if partition_bytes:  # the user's partition: credit still counts whole partitions of it
        partition = partition_bytes
    partitions = _power_of_two(
        _scaled(rule.credit_scale_bytes, rule.credit_exponent, delay) / partition,
        rule.min_credit_partitions,
        rule.max_credit_partitions,
    )
    return {
        "partition_bytes": partition,
        "credit_bytes": partition * partitions,
        "fusion_bytes": rule.fusion_bytes,
    }


def default_sizes(
    ranks: int,
    bandwidth_bytes_per_s: float,
    latency_s: float,
    rule: DefaultRule | None = None,
    partition_bytes: int | None = None,
    algorithm: str = "ring",
    rounds: str = "channel",
) -> dict[str, int]:
    """The default partition, credit and fusion sizes for a link (the fitted rule).

    Credit keeps the link busy while collectives in flight wait out their latency: it grows
    with the link's delay, the bytes the link moves during the message latencies of one
    allreduce under the transport's `algorithm` (collective_model; the ring's 2(n-1) at 1024
    ranks dwarf what a 2-rank job needs, halving-doubling's 2 log2 n do not). Partitions grow
    more slowly, so an urgent tensor still finds a chunk boundary soon. A given `partition_bytes`
    (not 0) is kept, and the credit counted in it. For a library's choice by size (mpich, nccl)
    the delay is that of the algorithm the library runs for a message of the partition picked
    under it: commsched's collectives are mostly whole partitions. Without a `rule`, the one for
    where agreement rounds travel: `rounds` "channel" (DEFAULT_RULE) or "data" (ROUNDS_ON_DATA_RULE).
    """
    if rule is None:
        if rounds not in ROUNDS:
            raise ValueError(f"rounds must be one of {', '.join(ROUNDS)}, got {rounds!r}")
        rule = DEFAULT_RULE if rounds == "channel" else ROUNDS_ON_DATA_RULE
    choices = collective_model.LIBRARY_CHOICES.get(collective_model.check_algorithm(algorithm), (algorithm,))
    fitted = [
        _sizes_for_delay(link_delay_bytes(ranks, bandwidth_bytes_per_s, latency_s, c), rule, partition_bytes)
        for c in choices
    ]
    for concrete, sizes in zip(choices, fitted):
        chosen = collective_model.resolve(
            algorithm, sizes["partition_bytes"], max(2, ranks), bandwidth_bytes_per_s, latency_s
        )
        if chosen == concrete and algorithm == "nccl":
            return _ring_sized_under_nccl(
                sizes, ranks, bandwidth_bytes_per_s, latency_s, rule, partition_bytes
            )
        if chosen == concrete:
            return sizes
    return fitted[0]


def _ring_sized_under_nccl(
    sizes: dict[str, int],
    ranks: int,
    bandwidth_bytes_per_s: float,
    latency_s: float,
    rule: DefaultRule,
    partition_bytes: int | None,
) -> dict[str, int]:
    """Under NCCL's choice, partitions just below the size where NCCL turns from its tree to its ring
    move twice their bytes (the tree's) where one partition more would move 2(n-1)/n: the partition
    grows to the ring's smallest size when the rule allows one that large (a partition the user set
    stays), and the credit then covers the ring's delay."""
    n = max(2, ranks)
    partition = sizes["partition_bytes"]
    if (
        partition_bytes
        or collective_model.resolve("nccl", partition, n, bandwidth_bytes_per_s, latency_s) != "tree"
    ):
        return sizes
    while partition < rule.max_partition_bytes:
        partition *= 2
        if collective_model.resolve("nccl", partition, n, bandwidth_bytes_per_s, latency_s) == "ring":
            delay = link_delay_bytes(ranks, bandwidth_bytes_per_s, latency_s, "ring")
            return _sizes_for_delay(delay, rule, partition)
    return sizes


# The fitted inline limit starts from the fixed default before it, and the core accepts at most
# MAX_INLINE_BYTES / ranks (every rank receives every rank's inline bytes in one round).
MIN_FITTED_INLINE_BYTES = 4 * 1024
MAX_INLINE_BYTES = 64 * 1024


def inline_cap_bytes(ranks: int) -> int:
    """The largest power of two the core accepts as the inline limit at `ranks` ranks."""
    return 1 << ((MAX_INLINE_BYTES // max(2, ranks)).bit_length() - 1)


def default_inline_bytes(
    ranks: int, bandwidth_bytes_per_s: float, latency_s: float, algorithm: str = "ring"
) -> int:
    """The largest power of two a tensor may have to ride in the agreement round, from 4 KiB (or the
    core's cap, when lower) to the core's cap (inline_cap_bytes).

    Inline, every rank receives the tensor from every other rank: (ranks - 1) times its bytes, in a
    round that runs anyway. Alone in a collective it would move the algorithm's own bytes and pay its
    message latencies. A tensor goes inline while the bytes it adds over the collective's take no
    longer than those latencies: at 2 ranks a ring moves as many bytes as the round, so always.
    """
    n = max(2, ranks)
    size = inline_cap_bytes(n)
    while size > MIN_FITTED_INLINE_BYTES:
        concrete = collective_model.resolve(algorithm, size, n, bandwidth_bytes_per_s, latency_s)
        added = (n - 1) * size - collective_model.wire_bytes(concrete, size, n)
        if added <= link_delay_bytes(n, bandwidth_bytes_per_s, latency_s, concrete):
            break
        size //= 2
    return size


_SIZE_FORM = "a byte count with an optional unit, e.g. 4MiB, 512KB or 1048576"
_DURATION_FORM = "seconds with an optional unit, e.g. 60, 30s or 500ms"
# field -> (environment variable, parser, accepted form)
_SPECS: dict[str, tuple[str, Callable[[Any], Any], str]] = {
    "policy": ("COMMSCHED_POLICY", _choice(POLICIES), "one of " + ", ".join(POLICIES)),
    "partition_bytes": ("COMMSCHED_PARTITION_BYTES", parse_size, _SIZE_FORM + " (0 turns partitioning off)"),
    "credit_bytes": (
        "COMMSCHED_CREDIT_BYTES",
        parse_size,
        _SIZE_FORM
        + " (unset: fitted to the link, see default_sizes; one partition per rank, 2 to 16, without one)",
    ),
    "fusion_bytes": ("COMMSCHED_FUSION_BYTES", parse_size, _SIZE_FORM + " (0 turns fusion off)"),
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
