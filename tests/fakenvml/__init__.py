"""Fake ``libnvidia-ml.so.1`` for exercising the *real* pynvml binding without a GPU.

``fake_nvml.c`` (next to this file) is compiled into ``libnvidia-ml.so.1``.
A subprocess started with :func:`env` (``LD_LIBRARY_PATH`` prepended) makes
``pynvml`` load it instead of the driver's library. What the fake reports is
read from a small text *state file* (env ``FAKE_NVML_STATE``), which the test
rewrites atomically with :meth:`FakeNode.write` while the subprocess runs: the
library notices the new file within ~50 ms and always on ``nvmlInit``
(``FAKE_NVML_RECHECK_MS`` sets that period; 0, as tests/inproc.py runs it: at
the next call).
``LD_LIBRARY_PATH`` only takes effect when a process starts, so the fake
can only be used from a *new* process.

Typical use::

    from fakenvml import FakeNode, build, env, read_counts

    lib_dir = build()                      # or build(old_driver=True)
    node = FakeNode.h200(count=8)
    node.gpus[3].lost = True
    node.gpus[0].set_error("nvmlDeviceGetPowerUsage", 3)     # NOT_SUPPORTED
    node.block("nvmlDeviceGetPowerUsage", seconds=30, gpu=2) # hang one GPU
    node.add_xid(gpu=1, xid=79)
    node.write(tmp_path / "state")
    subprocess.run([sys.executable, "agent.py"],
                   env=env(lib_dir, tmp_path / "state", tmp_path / "counts"))
    read_counts(tmp_path / "counts")["nvmlDeviceGetPowerUsage"]

Values use NVML's own units: mW, mJ, bytes, MHz, degrees C, ns. A reading set
to ``None`` (or an empty list/dict) is left out of the state file and the
fake answers ``NVML_ERROR_NOT_SUPPORTED`` (3) for it.

State file format (the full reference is the comment at the top of
``fake_nvml.c``): one ``key args...`` per line, ``#`` comments. Global keys
first (``init_error``, ``driver_version``, ``nvml_version``, ``cuda_version``,
``cuda_version_v2``, ``gpu_count``, ``fieldvalues_all_failed``,
``xid_after_register``, ``error <sym|*> <code>``, ``unsupported <sym>``,
``block <sym|*> <ms>``), then one section per GPU started by ``gpu <index>``:
identity (``uuid``, ``name``, ``pci_bus_id``, ``serial``, ``vbios``, ``minor``,
``architecture``, ``brand``, ...), readings (``temperature``,
``margin_temperature``, ``threshold <t> <C>``, ``fan <i> <pct> <target> <rpm>``,
``power_usage``, ``memory <total> <reserved> <used>``, ``clock <t> <MHz>``, ...),
``field <id> <type> <value>`` / ``field_error <id> <code>`` for
nvmlDeviceGetFieldValues, per-GPU ``error``/``unsupported``/``block`` lines,
``lost 1``, ``process compute|graphics <pid> <bytes>`` and ``xid <seq> <xid>``.
A per-GPU key that is absent means NOT_SUPPORTED.

Field values are produced here, from the same attributes as the plain calls,
so e.g. field 83 always equals nvmlDeviceGetTotalEnergyConsumption:

====================  =====================================  ==========
field ids             source attribute                       value type
====================  =====================================  ==========
3, 4, 5, 6            ``ecc_errors`` (SBE/DBE x VOL/AGG)     ull
31                    ``retired_pages_pending``              ui
74-79, 269-271        ``throttle_ns[id]``                    ull
82                    ``memory_temperature``                 ui
83                    ``energy_mj``                          ull
185                   ``power_mw`` (average power, mW)       ui
94                    ``pcie_replay``                        ui
142-145               ``remapped_rows``                      ui
193-196               ``tlimit_thresholds`` (T.Limit scale)  si
91; 165 @ link        ``nvlink_states`` (count; 1 = active)  ui
38 45 52 59 160       ``nvlink_errors`` totals over links    ull
161-163 @ link        ``nvlink_errors`` replay, recovery,    ull
                      crc_flit per link
138, 139 @ 0xFFFFFFFF ``nvlink_traffic_kib`` (tx, rx)        ull
185 @ 1               ``module_power_mw`` (scope MODULE)     ui
170; 171 @ link       ``c2c_links`` (count; 1 = active)      ui
172 @ link            ``c2c_max_bw_mbps`` (active links)     ui
231 232 233           ``c2c_errors`` crc, replay, b2b        ull
234 @ link            ``c2c_power_state`` (0 full, 1 low)    ui
anything              ``fields[id] = (type, value)``         as given
====================  =====================================  ==========

A scoped entry's key is ``(id, scopeId)`` (state file: ``field <id>:<scope>``).
GPM: ``gpm`` (metric id -> value) writes ``gpm_supported 1`` and a ``gpm <id>
<value>`` line per metric; ``fabric`` and ``fabric_cluster_uuid`` the fabric
lines (fake_nvml.c says what the calls do with them); ``c2c_mode`` the
``c2c_mode`` line (nvmlDeviceGetC2cModeInfoV's isC2cEnabled).

``field_errors[id] = code`` makes one entry fail. Unknown ids give a
per-entry NOT_SUPPORTED; the old-driver build answers every id > 200 with
INVALID_ARGUMENT (2).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import math
import os
import pathlib
import re
import shlex
import shutil
import struct
import subprocess
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = [
    "FakeGpu",
    "FakeMig",
    "FakeNode",
    "FakeNvmlBuildError",
    "FakeNvmlEnv",
    "NEW_SYMBOLS",
    "PROFILES",
    "build",
    "env",
    "make_gpu",
    "prepare",
    "read_counts",
    "symbols",
]

HERE = pathlib.Path(__file__).resolve().parent
SOURCE = HERE / "fake_nvml.c"
BUILD_ROOT = HERE / "build"
LIB_NAME = "libnvidia-ml.so.1"

MIB = 1024 * 1024

# NVML return codes used here.
SUCCESS = 0
ERROR_UNINITIALIZED = 1
ERROR_INVALID_ARGUMENT = 2
ERROR_NOT_SUPPORTED = 3
ERROR_NO_PERMISSION = 4
ERROR_DRIVER_NOT_LOADED = 9
ERROR_TIMEOUT = 10
ERROR_GPU_IS_LOST = 15
ERROR_LIB_RM_VERSION_MISMATCH = 18
ERROR_UNKNOWN = 999

# nvmlEventType* bits.
EVENT_SBE = 0x1
EVENT_DBE = 0x2
EVENT_PSTATE = 0x4
EVENT_XID = 0x8
EVENT_MIG_CONFIG = 0x100

# Symbols left out of the FAKE_OLD_DRIVER build (pynvml -> NVMLError_FunctionNotFound).
NEW_SYMBOLS = frozenset(
    {
        "nvmlDeviceGetTemperatureV",
        "nvmlDeviceGetMarginTemperature",
        "nvmlDeviceGetTargetFanSpeed",
        "nvmlDeviceGetFanSpeedRPM",
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetSupportedClocksEventReasons",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlGpmQueryDeviceSupport",
        "nvmlGpmSampleAlloc",
        "nvmlGpmSampleFree",
        "nvmlGpmSampleGet",
        "nvmlGpmMetricsGet",
        "nvmlDeviceGetGpuFabricInfoV",
        "nvmlGpmMigSampleGet",
        "nvmlDeviceGetC2cModeInfoV",
    }
)

# Value type names accepted by the state file's "field" lines (NVML_VALUE_TYPE_*).
VALUE_TYPES = ("d", "ui", "ul", "ull", "sll", "si", "us")

# C limits (keep in sync with fake_nvml.c).
MAX_GPUS = 64
MAX_FIELDS = 1024
MAX_GPM = 48
MAX_MIG = 7
MAX_MIG_GPM = 16
MAX_PROCS = 64
MAX_XIDS = 4096

_COUNT_SLOT = struct.Struct("=56sQ")
_COUNT_SLOTS = 128


class FakeNvmlBuildError(RuntimeError):
    """The fake library could not be compiled (no C compiler, or cc failed)."""


# ---------------------------------------------------------------------------
# Build / environment / counts
# ---------------------------------------------------------------------------

_build_lock = threading.Lock()


@functools.cache
def symbols() -> tuple[str, ...]:
    """All C symbol names the fake implements, in call-count slot order
    (parsed from the ``FAKE_SYMBOLS`` X-macro in ``fake_nvml.c``)."""
    text = SOURCE.read_text()
    start = text.index("#define FAKE_SYMBOLS(X)")
    end = text.index("#define SYM_ENUM")
    return tuple(re.findall(r"X\((nvml\w+)\)", text[start:end]))


def _check_symbol(name: str) -> str:
    if name != "*" and name not in symbols():
        raise ValueError(f"fake NVML has no symbol {name!r} (see fakenvml.symbols())")
    return name


def build(old_driver: bool = False) -> pathlib.Path:
    """Compile the fake library (once per variant) and return the directory
    that contains ``libnvidia-ml.so.1``.

    The result is cached in ``tests/fakenvml/build/{new,old}/`` and rebuilt
    when ``fake_nvml.c`` is newer than it. Safe to call from several threads
    and processes (flock + atomic rename). ``$CC`` overrides the compiler.
    ``old_driver=True`` compiles with ``-DFAKE_OLD_DRIVER``: the symbols in
    :data:`NEW_SYMBOLS` are missing and field ids > 200 are invalid.
    """
    variant = "old" if old_driver else "new"
    out_dir = BUILD_ROOT / variant
    lib = out_dir / LIB_NAME
    with _build_lock:
        if _up_to_date(lib):
            return out_dir
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if not cc:
            raise FakeNvmlBuildError(
                "cannot build the fake libnvidia-ml.so.1: no C compiler found "
                "(looked for $CC, cc, gcc, clang on PATH); install gcc or clang"
            )
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / ".lock", "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                if _up_to_date(lib):  # another process built it meanwhile
                    return out_dir
                tmp = out_dir / f".{LIB_NAME}.{os.getpid()}.tmp"
                cmd = [
                    *shlex.split(cc),
                    "-shared",
                    "-fPIC",
                    "-O2",
                    "-Wall",
                    "-Wextra",
                    "-Wl,-soname," + LIB_NAME,
                    *(["-DFAKE_OLD_DRIVER"] if old_driver else []),
                    "-o",
                    str(tmp),
                    str(SOURCE),
                    "-lpthread",
                ]
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
                except OSError as exc:
                    raise FakeNvmlBuildError(f"cannot run C compiler {cc!r}: {exc}") from exc
                if proc.returncode != 0:
                    with contextlib.suppress(OSError):
                        tmp.unlink()
                    raise FakeNvmlBuildError(
                        f"building the fake NVML library failed ({' '.join(cmd)}):\n{proc.stderr}"
                    )
                # rename: processes that already mapped the old file keep it intact
                os.replace(tmp, lib)
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)
    return out_dir


def _up_to_date(lib: pathlib.Path) -> bool:
    try:
        return lib.stat().st_mtime_ns >= SOURCE.stat().st_mtime_ns
    except FileNotFoundError:
        return False


def env(
    lib_dir: os.PathLike | str,
    state_path: os.PathLike | str,
    counts_path: os.PathLike | str | None = None,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """Environment for a subprocess that should load the fake library.

    Returns a copy of ``base`` (default ``os.environ``) with ``lib_dir``
    prepended to ``LD_LIBRARY_PATH`` and ``FAKE_NVML_STATE`` set. With
    ``counts_path`` the library keeps per-symbol call counts there
    (``FAKE_NVML_COUNTS``); without it any inherited ``FAKE_NVML_COUNTS`` is
    removed. Pass the result as ``env=`` to ``subprocess``.
    """
    out = dict(os.environ if base is None else base)
    old = out.get("LD_LIBRARY_PATH")
    out["LD_LIBRARY_PATH"] = str(lib_dir) + (os.pathsep + old if old else "")
    out["FAKE_NVML_STATE"] = str(state_path)
    if counts_path is not None:
        out["FAKE_NVML_COUNTS"] = str(counts_path)
    else:
        out.pop("FAKE_NVML_COUNTS", None)
    return out


def read_counts(counts_path: os.PathLike | str) -> dict[str, int]:
    """Per-C-symbol call counts from a ``FAKE_NVML_COUNTS`` file.

    Every symbol the library knows is present (0 if never called). Returns
    ``{}`` if the file does not exist yet (no process has loaded the library).
    Several processes may share one file; their counts add up.
    """
    try:
        data = pathlib.Path(counts_path).read_bytes()
    except FileNotFoundError:
        return {}
    counts: dict[str, int] = {}
    for i in range(min(_COUNT_SLOTS, len(data) // _COUNT_SLOT.size)):
        raw_name, count = _COUNT_SLOT.unpack_from(data, i * _COUNT_SLOT.size)
        name = raw_name.split(b"\0", 1)[0].decode("ascii", "replace")
        if name:
            counts[name] = count
    counts.pop(CPU_SLOT, None)
    return counts


CPU_SLOT = "__cpu_ns__"


def read_cpu_seconds(counts_path: os.PathLike | str) -> float:
    """CPU seconds the processes' threads spent inside the library (``FAKE_NVML_CPU=1``; 0 without):
    what a benchmark subtracts to get the agent's own cost."""
    try:
        data = pathlib.Path(counts_path).read_bytes()
    except FileNotFoundError:
        return 0.0
    for i in range(min(_COUNT_SLOTS, len(data) // _COUNT_SLOT.size)):
        raw_name, value = _COUNT_SLOT.unpack_from(data, i * _COUNT_SLOT.size)
        if raw_name.split(b"\0", 1)[0] == CPU_SLOT.encode():
            return value / 1e9
    return 0.0


# ---------------------------------------------------------------------------
# State model
# ---------------------------------------------------------------------------


def _ms(seconds: float | None) -> int:
    """Seconds -> the state file's block milliseconds (-1 = until removed)."""
    if seconds is None or math.isinf(seconds):
        return -1
    if seconds <= 0:
        return 0
    return max(1, round(seconds * 1000))


@dataclass
class FakeMig:
    """One MIG device (a compute instance of a GPU instance) of a FakeGpu."""

    gpu_instance: int
    compute_instance: int
    total: int  # bytes of its frame buffer
    used: int
    uuid: str  # "MIG-…"
    name: str  # "NVIDIA H100 80GB HBM3 MIG 3g.40gb": the profile follows "MIG "
    gpm: dict[int, float] = field(default_factory=dict)  # GPM metric id -> value (nvmlGpmMigSampleGet)


@dataclass
class FakeGpu:
    """One fake GPU. Attributes map 1:1 onto state-file lines.

    ``None`` / empty means "not supported" (NVML_ERROR_NOT_SUPPORTED). Units
    are NVML's: mW, mJ, bytes, MHz, degrees C, ns. Build realistic ones with
    :func:`make_gpu` or the :class:`FakeNode` constructors; mutate freely,
    then :meth:`FakeNode.write`.
    """

    # identity
    uuid: str | None = "GPU-00000000-0000-0000-0000-000000000000"
    name: str | None = "NVIDIA Fake GPU"
    pci_bus_id: str | None = "00000000:01:00.0"  # "dddddddd:bb:dd.f", hex
    serial: str | None = None  # <= 29 chars (NVML's buffer is 30)
    vbios: str | None = None
    minor: int | None = 0
    architecture: int | None = 9  # NVML_DEVICE_ARCH_*: 6 Turing, 8 Ada, 9 Hopper
    brand: int | None = 14  # NVML_BRAND_*: 5 GeForce, 14 NVIDIA
    persistence: int | None = 1
    pci_device_id: int | None = None
    pci_subsystem_id: int | None = None
    cuda_cc: tuple[int, int] | None = None

    # temperatures (C)
    temperature: int | None = 30
    margin_temperature: int | None = None  # nvmlDeviceGetMarginTemperature (T.Limit)
    memory_temperature: int | None = None  # field 82
    thresholds: dict[int, int] = field(default_factory=dict)  # GetTemperatureThreshold type -> C
    tlimit_thresholds: tuple[int | None, int | None, int | None, int | None] | None = None  # fields 193-196

    # fans: one entry per fan; [] = no fans (all fan calls NOT_SUPPORTED).
    # An entry of None in fan_rpms / fan_targets = that reading NOT_SUPPORTED.
    fan_speeds: list[int] = field(default_factory=list)  # %
    fan_targets: list[int | None] = field(default_factory=list)  # % (defaults to fan_speeds)
    fan_rpms: list[int | None] = field(default_factory=list)

    # power
    power_mw: int | None = 100_000
    energy_mj: int | None = 0
    power_limit_mw: int | None = None  # nvmlDeviceGetPowerManagementLimit
    enforced_power_limit_mw: int | None = None
    default_power_limit_mw: int | None = None
    power_limit_constraints_mw: tuple[int, int] | None = None
    pstate: int | None = 0

    # utilization / memory (bytes)
    utilization: tuple[int, int] | None = (0, 0)  # (gpu %, memory %)
    encoder_utilization: tuple[int, int] | None = (0, 167_000)  # (%, sampling period us)
    decoder_utilization: tuple[int, int] | None = (0, 167_000)
    memory_total: int | None = 16 * 1024 * MIB
    memory_reserved: int = 0
    memory_used: int = 0  # excluding reserved (nvmlMemory_v2 semantics)

    # clocks (MHz), index = NVML_CLOCK_GRAPHICS 0, SM 1, MEM 2, VIDEO 3
    clocks: list[int | None] = field(default_factory=list)
    max_clocks: list[int | None] = field(default_factory=list)
    clocks_event_reasons: int | None = 0
    supported_clocks_event_reasons: int | None = 0x1FF

    # PCIe
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_max_gen: int | None = None
    pcie_max_width: int | None = None
    pcie_replay: int | None = 0

    # health
    ecc_mode: tuple[int, int] | None = None  # (current, pending)
    ecc_errors: dict[tuple[int, int], int] | None = None  # (errType 0 SBE/1 DBE, counter 0 VOL/1 AGG)
    remapped_rows: tuple[int, int, int, int] | None = None  # (corr, unc, pending, failure)
    retired_pages_pending: int | None = None
    # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (field 230, R570+): every capture's driver reports it ("GPU Recovery
    # Action: None" = 0); None: a driver without it (the entry fails)
    recovery_action: int | None = 0
    # field id (74-79, 269-271: the R580.126+ numbering; written under the node's driver branch's ids) -> ns
    throttle_ns: dict[int, int] = field(default_factory=dict)
    # power smoothing (Blackwell), by its R580.126+ id (251 enabled, 258 HW circuitry % lifetime remaining, ...)
    power_smoothing: dict[int, int] = field(default_factory=dict)

    # data-center depth (SXM boards on NVSwitch): GPM, NVLink, fabric
    gpm: dict[int, float] | None = None  # GPM metric id -> value (% or MiB/s); None: no GPM (pre-Hopper)
    nvlink_states: list[int] = field(default_factory=list)  # per link: 1 active, 0 inactive; []: no NVLink
    # crc_flit | crc_data | replay | recovery | ecc_data -> per-link counts; the driver's totals
    # (fields 38, 45, 52, 59, 160) are their sums, replay/recovery/crc_flit also per link (161-163)
    nvlink_errors: dict[str, list[int]] = field(default_factory=dict)
    nvlink_traffic_kib: tuple[int, int] | None = None  # (tx, rx) data KiB over all links (fields 138/139)
    # NVLink5 (Blackwell): counter name (NVLINK5_FIELDS) -> per-link counts, answered per link (scopeId =
    # link) and, with nvlink5_aggregate, as the device total (scopeId 0xFFFFFFFF); BER name -> packed value
    nvlink5_errors: dict[str, list[int]] = field(default_factory=dict)
    nvlink5_ber: dict[str, int] = field(default_factory=dict)
    nvlink5_aggregate: bool = True
    # link -> (remote device type: 0 GPU, 2 NVSwitch; the remote end's PCI bus id)
    nvlink_remotes: dict[int, tuple[int, str]] = field(default_factory=dict)
    fabric: tuple[int, int, int, int] | None = None  # (state 0-3, status, cliqueId, healthMask); None: no fabric
    fabric_cluster_uuid: str | None = None  # 32 hex digits
    # the driver answers nvmlDeviceGetGpuFabricInfoV's v3 structure (R570+) with this health summary (0 not
    # supported, 1 healthy, 2 unhealthy, 3 limited capacity); None: a driver before R570, which answers the
    # v3 version ARGUMENT_VERSION_MISMATCH (v2 still works)
    fabric_health_summary: int | None = 0

    # Grace-coupled GPUs (GH200, GB200): C2C mode (nvmlDeviceGetC2cModeInfoV isC2cEnabled; None: NOT_SUPPORTED),
    # the C2C links (per link: 1 active, 0 inactive; []: no C2C), their speed (MB/s, active links), the error
    # counters (crc | replay | replay_b2b; R575+), each link's power state (0 full, 1 low; []: not reported),
    # and the module-scope power (field 185 with scopeId 1; None: NOT_SUPPORTED, as on NVIDIA's mock)
    c2c_mode: int | None = None
    nvlink_version: int | None = None  # nvmlDeviceGetNvLinkVersion: NVML_NVLINK_VERSION_* (6 = 4.0, 7 = 5.0)
    c2c_links: list[int] = field(default_factory=list)
    c2c_max_bw_mbps: int | None = None
    c2c_errors: dict[str, int] = field(default_factory=dict)
    c2c_power_state: list[int] = field(default_factory=list)
    module_power_mw: int | None = None

    # MIG: (current, pending) mode, None = no MIG (NOT_SUPPORTED); the MIG devices by slot (the index of
    # nvmlDeviceGetMigDeviceHandleByIndex). With MIG on, device-level GPM answers NOT_SUPPORTED (per
    # instance only: nvmlGpmMigSampleGet)
    mig_mode: tuple[int, int] | None = None
    mig_devices: dict[int, FakeMig] = field(default_factory=dict)

    # field values: extra / overriding entries and per-entry failures; a key is an id (scope 0)
    # or (id, scopeId)
    fields: dict[int | tuple[int, int], tuple[str, int | float]] = field(default_factory=dict)
    field_errors: dict[int | tuple[int, int], int] = field(default_factory=dict)  # -> per-entry nvmlReturn
    # id -> the fewest entries a call must have for the id's entry to answer (field_min_batch: what an H200 on
    # R580.159 does with field 258, a double 0.0 in a batch of 35 ids, NOT_SUPPORTED alone or among 15)
    field_min_batch: dict[int | tuple[int, int], int] = field(default_factory=dict)

    # events
    supported_event_types: int | None = EVENT_PSTATE | EVENT_XID
    xids: list[tuple[int, int]] = field(default_factory=list)  # (seq, xid); use FakeNode.add_xid
    events: list[tuple[int, int, int]] = field(default_factory=list)  # (seq, type, data); FakeNode.add_event

    # processes: (pid, used bytes or None = NVML_VALUE_NOT_AVAILABLE[, gpu instance, compute instance])
    compute_processes: list[tuple] = field(default_factory=list)
    graphics_processes: list[tuple] = field(default_factory=list)

    # fault injection
    lost: bool = False  # every per-device call -> NVML_ERROR_GPU_IS_LOST (15)
    errors: dict[str, int] = field(default_factory=dict)  # symbol (or "*") -> code
    unsupported: set[str] = field(default_factory=set)  # symbols -> NOT_SUPPORTED
    blocks: dict[str, int] = field(default_factory=dict)  # symbol (or "*") -> ms (-1 forever)

    # -- helpers -----------------------------------------------------------

    def set_error(self, symbol: str, code: int) -> None:
        """Make every call of C ``symbol`` on this GPU return ``code``
        (``"*"`` = every symbol)."""
        self.errors[_check_symbol(symbol)] = int(code)

    def clear_error(self, symbol: str | None = None) -> None:
        """Remove one injected error, or all of them (also ``unsupported``)."""
        if symbol is None:
            self.errors.clear()
            self.unsupported.clear()
        else:
            self.errors.pop(symbol, None)
            self.unsupported.discard(symbol)

    def block(self, symbol: str, seconds: float | None) -> None:
        """Make calls of ``symbol`` on this GPU sleep ``seconds`` before
        answering (``None``/``inf`` = until :meth:`unblock` + write)."""
        ms = _ms(seconds)
        if ms:
            self.blocks[_check_symbol(symbol)] = ms
        else:
            self.blocks.pop(symbol, None)

    def unblock(self, symbol: str | None = None) -> None:
        if symbol is None:
            self.blocks.clear()
        else:
            self.blocks.pop(symbol, None)

    def set_field(self, field_id: int | tuple[int, int], value: int | float, type: str = "ull") -> None:
        """Add or override a nvmlDeviceGetFieldValues entry (``(id, scopeId)`` for a scoped one)."""
        if type not in VALUE_TYPES:
            raise ValueError(f"field type must be one of {VALUE_TYPES}")
        self.fields[_field_key(field_id)] = (type, value)

    def set_field_error(self, field_id: int | tuple[int, int], code: int) -> None:
        """Make one field id fail with a per-entry ``nvmlReturn`` of ``code``."""
        self.field_errors[_field_key(field_id)] = int(code)

    def add_process(self, pid: int, used_bytes: int | None, kind: str = "compute",
                    mig: tuple[int, int] | None = None) -> None:
        """A process on the GPU; ``mig`` = (gpu instance, compute instance) when it runs on a MIG device."""
        if kind not in ("compute", "graphics"):
            raise ValueError("kind must be 'compute' or 'graphics'")
        entry = (int(pid), used_bytes) if mig is None else (int(pid), used_bytes, int(mig[0]), int(mig[1]))
        getattr(self, f"{kind}_processes").append(entry)

    # -- derived field values ----------------------------------------------

    def field_values(self, driver_version: str = "590.48.01") -> dict[int | tuple[int, int], tuple[str, int | float]]:
        """The nvmlDeviceGetFieldValues entries this GPU reports (id or (id, scopeId) -> (type, value)),
        the ids that moved between driver branches numbered as ``driver_version``'s branch numbers them."""
        out: dict[int | tuple[int, int], tuple[str, int | float]] = {}
        ids = branch_ids(driver_version)
        if self.ecc_errors is not None:
            for fid, key in ((3, (0, 0)), (4, (1, 0)), (5, (0, 1)), (6, (1, 1))):
                if key in self.ecc_errors:
                    out[fid] = ("ull", self.ecc_errors[key])
        if self.retired_pages_pending is not None:
            out[31] = ("ui", self.retired_pages_pending)
        for kind, moved in (("ull", self.throttle_ns), ("ui", self.power_smoothing)):
            for fid, value in moved.items():
                target = ids.get(int(fid), int(fid))
                if target is not None:
                    out[target] = (kind, value)
        if self.memory_temperature is not None:
            out[82] = ("ui", self.memory_temperature)
        if self.energy_mj is not None:
            out[83] = ("ull", self.energy_mj)
        if self.power_mw is not None:  # NVML_FI_DEV_POWER_AVERAGE, scope GPU: what GetPowerUsage reports
            out[185] = ("ui", self.power_mw)
        if self.pcie_replay is not None:
            out[94] = ("ui", self.pcie_replay)
        if self.remapped_rows is not None:
            for fid, v in zip((142, 143, 144, 145), self.remapped_rows):
                out[fid] = ("ui", v)
        if self.recovery_action is not None:
            out[230] = ("ui", self.recovery_action)
        if self.tlimit_thresholds is not None:
            for fid, v in zip((193, 194, 195, 196), self.tlimit_thresholds):
                if v is not None:
                    out[fid] = ("si", v)
        if self.nvlink_states:
            out[91] = ("ui", len(self.nvlink_states))  # NVML_FI_DEV_NVLINK_LINK_COUNT
            for link, state in enumerate(self.nvlink_states):
                out[_field_key((165, link))] = ("ui", state)  # NVML_FI_DEV_NVLINK_GET_STATE, scope = link
            for name, counts in self.nvlink_errors.items():
                out[NVLINK_TOTAL_FIELDS[name]] = ("ull", sum(counts))
                if name in NVLINK_LINK_FIELDS:
                    for link, n in enumerate(counts):
                        out[_field_key((NVLINK_LINK_FIELDS[name], link))] = ("ull", n)
        for name, counts in self.nvlink5_errors.items():
            fid = NVLINK5_FIELDS[name]
            for link, n in enumerate(counts):
                out[_field_key((fid, link))] = ("ull", n)
            if self.nvlink5_aggregate:
                out[(fid, ALL_LINKS)] = ("ull", sum(counts))
        for name, packed in self.nvlink5_ber.items():
            fid = NVLINK5_FIELDS[name + "_ber"]
            for link in range(len(self.nvlink_states)):
                out[_field_key((fid, link))] = ("ull", packed)
            if self.nvlink5_aggregate:
                out[(fid, ALL_LINKS)] = ("ull", packed)
        if self.nvlink_traffic_kib is not None:
            out[(138, ALL_LINKS)] = ("ull", self.nvlink_traffic_kib[0])
            out[(139, ALL_LINKS)] = ("ull", self.nvlink_traffic_kib[1])
        if self.module_power_mw is not None:
            out[(185, POWER_SCOPE_MODULE)] = ("ui", self.module_power_mw)
        if self.c2c_links:
            out[170] = ("ui", len(self.c2c_links))  # NVML_FI_DEV_C2C_LINK_COUNT
            for link, state in enumerate(self.c2c_links):
                out[_field_key((171, link))] = ("ui", state)  # NVML_FI_DEV_C2C_LINK_GET_STATUS, scope = link
                if state and self.c2c_max_bw_mbps is not None:
                    out[_field_key((172, link))] = ("ui", self.c2c_max_bw_mbps)
            for link, state in enumerate(self.c2c_power_state):
                out[_field_key((234, link))] = ("ui", state)  # NVML_FI_DEV_C2C_LINK_POWER_STATE
            for name, count in self.c2c_errors.items():
                out[C2C_ERROR_FIELDS[name]] = ("ull", count)
        out.update(self.fields)
        return out

    # -- serialization -----------------------------------------------------

    def lines(self, index: int, driver_version: str = "590.48.01") -> list[str]:
        """State-file lines for this GPU as GPU ``index`` of a node whose driver is ``driver_version``."""
        L = [f"gpu {index}"]

        def put(key: str, *vals) -> None:
            if any(v is None for v in vals):
                return
            L.append(" ".join([key, *(_num(v) for v in vals)]))

        def put_hex(key: str, v) -> None:
            if v is not None:
                L.append(f"{key} {int(v):#x}")

        for key in ("uuid", "name", "pci_bus_id", "serial", "vbios"):
            v = getattr(self, key)
            if v is not None:
                if "\n" in str(v):
                    raise ValueError(f"{key} must be a single line")
                L.append(f"{key} {v}")
        put("minor", self.minor)
        put("architecture", self.architecture)
        put("brand", self.brand)
        put("persistence", self.persistence)
        put_hex("pci_device_id", self.pci_device_id)
        put_hex("pci_subsystem_id", self.pci_subsystem_id)
        if self.cuda_cc is not None:
            put("cuda_cc", *self.cuda_cc)
        put("temperature", self.temperature)
        put("margin_temperature", self.margin_temperature)
        for t, c in sorted(self.thresholds.items()):
            put("threshold", t, c)
        for i, speed in enumerate(self.fan_speeds):
            target = self.fan_targets[i] if i < len(self.fan_targets) else speed
            rpm = self.fan_rpms[i] if i < len(self.fan_rpms) else None
            L.append(" ".join(["fan", str(i), *(_num_na(v) for v in (speed, target, rpm))]))
        put("power_usage", self.power_mw)
        put("total_energy", self.energy_mj)
        put("power_limit", self.power_limit_mw)
        put("enforced_power_limit", self.enforced_power_limit_mw)
        put("default_power_limit", self.default_power_limit_mw)
        if self.power_limit_constraints_mw is not None:
            put("power_limit_constraints", *self.power_limit_constraints_mw)
        put("pstate", self.pstate)
        if self.utilization is not None:
            put("utilization", *self.utilization)
        if self.encoder_utilization is not None:
            put("encoder_utilization", *self.encoder_utilization)
        if self.decoder_utilization is not None:
            put("decoder_utilization", *self.decoder_utilization)
        put("memory", self.memory_total, self.memory_reserved, self.memory_used)
        for t, mhz in enumerate(self.clocks):
            put("clock", t, mhz)
        for t, mhz in enumerate(self.max_clocks):
            put("max_clock", t, mhz)
        put_hex("clocks_event_reasons", self.clocks_event_reasons)
        put_hex("supported_clocks_event_reasons", self.supported_clocks_event_reasons)
        put("pcie_gen", self.pcie_gen)
        put("pcie_width", self.pcie_width)
        put("pcie_max_gen", self.pcie_max_gen)
        put("pcie_max_width", self.pcie_max_width)
        put("pcie_replay", self.pcie_replay)
        if self.ecc_mode is not None:
            put("ecc_mode", *self.ecc_mode)
        for (et, ct), n in sorted((self.ecc_errors or {}).items()):
            put("ecc_errors", et, ct, n)
        if self.remapped_rows is not None:
            put("remapped_rows", *self.remapped_rows)
        put("retired_pages_pending", self.retired_pages_pending)
        put_hex("supported_event_types", self.supported_event_types)
        fv = self.field_values(driver_version)
        if len(fv.keys() | self.field_errors.keys()) > MAX_FIELDS:
            raise ValueError(f"at most {MAX_FIELDS} field ids per GPU")
        for key, (typ, val) in sorted(fv.items(), key=lambda kv: _scoped(kv[0])):
            if typ not in VALUE_TYPES:
                raise ValueError(f"field {key}: type must be one of {VALUE_TYPES}")
            fid = _field_text(key)
            L.append(f"field {fid} {typ} {val!r}" if typ == "d" else f"field {fid} {typ} {int(val)}")
        for key, code in sorted(self.field_errors.items(), key=lambda kv: _scoped(kv[0])):
            put("field_error", _field_text(key), code)
        for key, least in sorted(self.field_min_batch.items(), key=lambda kv: _scoped(kv[0])):
            put("field_min_batch", _field_text(key), least)
        if self.gpm is not None:
            if len(self.gpm) > MAX_GPM:
                raise ValueError(f"at most {MAX_GPM} GPM metrics per GPU")
            L.append("gpm_supported 1")
            for metric, value in sorted(self.gpm.items()):
                L.append(f"gpm {int(metric)} {float(value)!r}")
        if self.mig_mode is not None:
            put("mig_mode", *self.mig_mode)
        for slot, m in sorted(self.mig_devices.items()):
            if not 0 <= slot < MAX_MIG or len(m.gpm) > MAX_MIG_GPM:
                raise ValueError(f"MIG slot {slot}: 0..{MAX_MIG - 1}, at most {MAX_MIG_GPM} GPM metrics")
            L.append(f"mig {slot} {m.gpu_instance} {m.compute_instance} {m.total} {m.used} {m.uuid} {m.name}")
            for metric, value in sorted(m.gpm.items()):
                L.append(f"mig_gpm {slot} {int(metric)} {float(value)!r}")
        for link, (kind, bus) in sorted(self.nvlink_remotes.items()):
            L.append(f"nvlink_remote {int(link)} {int(kind)} {bus}")
        if self.fabric is not None:
            put("fabric", *self.fabric)
            if self.fabric_cluster_uuid is not None:
                L.append(f"fabric_cluster_uuid {self.fabric_cluster_uuid}")
        put("c2c_mode", self.c2c_mode)
        put("nvlink_version", self.nvlink_version)
        if self.fabric_health_summary is not None:
            put("fabric_summary", self.fabric_health_summary)
        if self.lost:
            L.append("lost 1")
        for sym in sorted(self.unsupported):
            L.append(f"unsupported {_check_symbol(sym)}")
        for sym, code in sorted(self.errors.items()):
            put("error", _check_symbol(sym), code)
        for sym, ms in sorted(self.blocks.items()):
            put("block", _check_symbol(sym), ms)
        for kind in ("compute", "graphics"):
            procs = getattr(self, f"{kind}_processes")
            if len(procs) > MAX_PROCS:
                raise ValueError(f"at most {MAX_PROCS} {kind} processes per GPU")
            for pid, used, *instance in procs:
                L.append(" ".join(["process", kind, str(int(pid)), _num_na(used), *map(str, instance)]))
        for seq, xid in self.xids:
            put("xid", seq, xid)
        for seq, kind, data in self.events:
            L.append(f"event {int(seq)} {int(kind):#x} {int(data)}")
        return L


ALL_LINKS = 0xFFFFFFFF  # scopeId of the NVLink throughput fields: every link
NVLINK_TOTAL_FIELDS = {"crc_flit": 38, "crc_data": 45, "replay": 52, "recovery": 59, "ecc_data": 160}
NVLINK_LINK_FIELDS = {"replay": 161, "recovery": 162, "crc_flit": 163}  # NVML_FI_DEV_NVLINK_ERROR_DL_*
C2C_ERROR_FIELDS = {"crc": 231, "replay": 232, "replay_b2b": 233}  # NVML_FI_DEV_C2C_LINK_ERROR_INTR/_REPLAY/_B2B
POWER_SCOPE_MODULE = 1  # NVML_POWER_SCOPE_MODULE: GPU + Grace CPU + memory


# NVLink5 counters (NVML_FI_DEV_NVLINK_COUNT_*), by the names gpuwatch exports them under
NVLINK5_FIELDS = {"malformed_packet": 206, "buffer_overrun": 207, "receive": 208, "remote": 209, "general": 210,
                  "local_link_integrity": 211, "transmit_discards": 212, "recovery_successful": 213,
                  "recovery_failed": 214, "recovery": 215, "effective": 219, "effective_ber": 220, "symbol": 221,
                  "symbol_ber": 222}


def pack_ber(mantissa: int, exponent: int) -> int:
    """A BER as NVML packs it (NVML_NVLINK_ERROR_COUNTER_BER_GET): mantissa in bits 8-11, exponent in bits 0-7,
    BER = mantissa x 10^-exponent; pack_ber(15, 255) is "no errors"."""
    return (mantissa & 0xF) << 8 | exponent & 0xFF


def branch_ids(driver_version: str) -> dict[int, int | None]:
    """How a driver branch numbers the field ids that moved, from the R580.126+ numbering (the CUDA 13.1.2+
    headers) to the branch's own; None: the branch has no such field. Written from the headers' history
    (shared/reference/nvml-generations-and-peers-2026.md §2.2), independently of gpuwatch's own table.

    - R575 and R580 before 580.126 (CUDA 12.9/13.0): throttle counters 269-271 at 251-253, power-sync
      balancing 272-273 at 254-255, power smoothing 251-268 at 256-273.
    - R570 (CUDA 12.8): the R580.126+ numbering.
    - before R570: no power smoothing, no throttle counters past 79; R555/R560 (CUDA 12.5/12.6) swap 199/200.
    """
    parts = [int(p) for p in re.findall(r"\d+", driver_version)[:2]] + [0, 0]
    major, minor = parts[0], parts[1]
    moved = range(251, 274)
    if major < 570:
        ids: dict[int, int | None] = dict.fromkeys(moved)
        if major in (555, 560):
            ids.update({199: 200, 200: 199})
        return ids
    if major == 575 or (major == 580 and minor < 126):
        ids = {269: 251, 270: 252, 271: 253, 272: 254, 273: 255}
        ids.update({fid: fid + 5 for fid in range(251, 269)})
        return ids
    return {}


def _field_key(key: int | tuple[int, int]) -> int | tuple[int, int]:
    if isinstance(key, tuple):
        fid, scope = int(key[0]), int(key[1])
        return fid if scope == 0 else (fid, scope)
    return int(key)


def _scoped(key: int | tuple[int, int]) -> tuple[int, int]:
    return key if isinstance(key, tuple) else (key, 0)


def _field_text(key: int | tuple[int, int]) -> str:
    fid, scope = _scoped(key)
    return f"{fid}:{scope}" if scope else str(fid)


def _num(v) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, str):
        return v
    return str(int(v))


def _num_na(v) -> str:
    return "na" if v is None else _num(v)


@dataclass
class FakeNode:
    """A host: global NVML settings plus ``gpus`` (index = position).

    Mutate attributes or use the helpers, then :meth:`write` the state file;
    a running process picks the change up within ~50 ms.
    """

    gpus: list[FakeGpu] = field(default_factory=list)
    init_error: int = 0  # nvmlInitWithFlags result: 9 DRIVER_NOT_LOADED, 18 LIB_RM_VERSION_MISMATCH, ...
    driver_version: str = "590.48.01"
    nvml_version: str = "13.590.48.01"
    cuda_version: int = 13010  # nvmlSystemGetCudaDriverVersion (13.1)
    cuda_version_v2: int | None = None  # defaults to cuda_version
    gpu_count: int | None = None  # override nvmlDeviceGetCount_v2 (default len(gpus))
    errors: dict[str, int] = field(default_factory=dict)  # all GPUs + system calls: symbol/"*" -> code
    unsupported: set[str] = field(default_factory=set)
    blocks: dict[str, int] = field(default_factory=dict)  # symbol/"*" -> ms, all GPUs + system calls
    fieldvalues_all_failed: int | None = None  # GetFieldValues result when no entry succeeded
    xid_after_register: bool = False  # True: XIDs queued before registration are not delivered
    next_xid_seq: int = 1

    # -- constructors --------------------------------------------------------

    @classmethod
    def h200(cls, count: int = 8, **node_kw) -> FakeNode:
        """``count`` idle NVIDIA H200 SXM GPUs (values from the H200 capture)."""
        return cls.from_profiles(["h200"] * count, **node_kw)

    @classmethod
    def h100(cls, count: int = 8, **node_kw) -> FakeNode:
        return cls.from_profiles(["h100"] * count, **node_kw)

    @classmethod
    def b200(cls, count: int = 8, **node_kw) -> FakeNode:
        """``count`` HGX B200 GPUs (NVLink5) on an R580.126+ driver (580.126.09) unless ``driver_version`` says."""
        node_kw.setdefault("driver_version", "580.126.09")
        node_kw.setdefault("nvml_version", "13.580.126.09")
        return cls.from_profiles(["b200"] * count, **node_kw)

    @classmethod
    def a100(cls, count: int = 8, **node_kw) -> FakeNode:
        """``count`` HGX A100 GPUs on an R550 driver (550.163.01, as NVIDIA's mock) unless ``driver_version`` says."""
        node_kw.setdefault("driver_version", "550.163.01")
        node_kw.setdefault("nvml_version", "12.550.163.01")
        node_kw.setdefault("cuda_version", 12040)
        return cls.from_profiles(["a100"] * count, **node_kw)

    @classmethod
    def rtx4090(cls, count: int = 1, **node_kw) -> FakeNode:
        return cls.from_profiles(["rtx4090"] * count, **node_kw)

    @classmethod
    def h100_mig(cls, count: int = 1, **node_kw) -> FakeNode:
        return cls.from_profiles(["h100-mig"] * count, **node_kw)

    @classmethod
    def gh200(cls, count: int = 4, **node_kw) -> FakeNode:
        """``count`` Grace Hopper superchips' GPUs (one per superchip, no NVSwitch): C2C, module power."""
        return cls.from_profiles(["gh200"] * count, **node_kw)

    @classmethod
    def gb200(cls, count: int = 4, **node_kw) -> FakeNode:
        """``count`` GB200 GPUs (a compute tray: 2 per Grace) on driver 580.65.06, after NVIDIA's mock
        configuration: NVLink5 through the NVSwitches, fabric, C2C, module power."""
        node_kw = {"driver_version": "580.65.06", "nvml_version": "13.580.65", "cuda_version": 13000, **node_kw}
        return cls.from_profiles(["gb200"] * count, **node_kw)

    @classmethod
    def l40s(cls, count: int = 4, **node_kw) -> FakeNode:
        return cls.from_profiles(["l40s"] * count, **node_kw)

    @classmethod
    def rtx(cls, count: int = 1, **node_kw) -> FakeNode:
        """``count`` GeForce RTX 4080 SUPER cards: two fans, absolute thresholds,
        no margin/memory temperature, no ECC/remapped rows/retired pages."""
        return cls.from_profiles(["rtx"] * count, **node_kw)

    @classmethod
    def from_profiles(cls, profiles: Iterable[str | FakeGpu], **node_kw) -> FakeNode:
        """A node from profile names (see :data:`PROFILES`) and/or ready FakeGpu
        objects, e.g. ``FakeNode.from_profiles(["h200", "h200", "rtx"])``."""
        gpus = [p if isinstance(p, FakeGpu) else make_gpu(p, i) for i, p in enumerate(profiles)]
        return cls(gpus=gpus, **node_kw)

    # -- helpers ---------------------------------------------------------------

    def set_error(self, symbol: str, code: int, gpu: int | None = None) -> None:
        """Inject ``code`` for C ``symbol`` on one GPU, or on all GPUs and the
        system calls (``gpu=None``). ``"*"`` = every symbol but init/shutdown."""
        if gpu is None:
            self.errors[_check_symbol(symbol)] = int(code)
        else:
            self.gpus[gpu].set_error(symbol, code)

    def clear_error(self, symbol: str | None = None, gpu: int | None = None) -> None:
        if gpu is not None:
            self.gpus[gpu].clear_error(symbol)
        elif symbol is None:
            self.errors.clear()
            self.unsupported.clear()
        else:
            self.errors.pop(symbol, None)
            self.unsupported.discard(symbol)

    def block(self, symbol: str, seconds: float | None, gpu: int | None = None) -> None:
        """Make ``symbol`` sleep ``seconds`` inside the call (on one GPU, or
        everywhere). ``None``/``inf`` blocks until :meth:`unblock` + write; a
        running call notices removal within ~50 ms."""
        if gpu is not None:
            self.gpus[gpu].block(symbol, seconds)
            return
        ms = _ms(seconds)
        if ms:
            self.blocks[_check_symbol(symbol)] = ms
        else:
            self.blocks.pop(symbol, None)

    def unblock(self, symbol: str | None = None, gpu: int | None = None) -> None:
        if gpu is not None:
            self.gpus[gpu].unblock(symbol)
        elif symbol is None:
            self.blocks.clear()
        else:
            self.blocks.pop(symbol, None)

    def add_xid(self, gpu: int, xid: int) -> int:
        """Queue an XID critical-error event on ``gpu``; returns its sequence
        number. Each event set receives it once."""
        seq = self.next_xid_seq
        self.next_xid_seq += 1
        self.gpus[gpu].xids.append((seq, int(xid)))
        return seq

    def add_event(self, gpu: int, kind: int, data: int = 0) -> int:
        """Queue an event of another type on ``gpu`` (e.g. EVENT_MIG_CONFIG); delivered like XIDs to the
        event sets registered for that type; returns its sequence number."""
        seq = self.next_xid_seq
        self.next_xid_seq += 1
        self.gpus[gpu].events.append((seq, int(kind), int(data)))
        return seq

    # -- serialization ---------------------------------------------------------

    def render(self) -> str:
        """The state file text."""
        if len(self.gpus) > MAX_GPUS:
            raise ValueError(f"the fake supports at most {MAX_GPUS} GPUs")
        if sum(len(g.xids) for g in self.gpus) > MAX_XIDS:
            raise ValueError(f"at most {MAX_XIDS} queued XIDs")
        L = [
            "# fake NVML state (tests/fakenvml); format: see fake_nvml.c",
            f"init_error {int(self.init_error)}",
            f"driver_version {self.driver_version}",
            f"nvml_version {self.nvml_version}",
            f"cuda_version {int(self.cuda_version)}",
        ]
        if self.cuda_version_v2 is not None:
            L.append(f"cuda_version_v2 {int(self.cuda_version_v2)}")
        L.append(f"gpu_count {len(self.gpus) if self.gpu_count is None else int(self.gpu_count)}")
        if self.fieldvalues_all_failed is not None:
            L.append(f"fieldvalues_all_failed {int(self.fieldvalues_all_failed)}")
        if self.xid_after_register:
            L.append("xid_after_register 1")
        for sym in sorted(self.unsupported):
            L.append(f"unsupported {_check_symbol(sym)}")
        for sym, code in sorted(self.errors.items()):
            L.append(f"error {_check_symbol(sym)} {int(code)}")
        for sym, ms in sorted(self.blocks.items()):
            L.append(f"block {_check_symbol(sym)} {int(ms)}")
        for i, g in enumerate(self.gpus):
            L.extend(g.lines(i, self.driver_version))
        return "\n".join(L) + "\n"

    def write(self, path: os.PathLike | str) -> pathlib.Path:
        """Write the state file atomically (temp file in the same directory +
        rename), so a running process never sees a half-written file."""
        path = pathlib.Path(path)
        text = self.render()
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            # surrogateescape: a test may put bytes that are not UTF-8 into a string ("PSN\udcb0"
            # is written as b"PSN\xb0"), as a corrupted InfoROM would report them
            with os.fdopen(fd, "wb") as f:
                f.write(text.encode("utf-8", "surrogateescape"))
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path


# ---------------------------------------------------------------------------
# Convenience bundle
# ---------------------------------------------------------------------------


@dataclass
class FakeNvmlEnv:
    """Paths + environment for one fake-NVML setup (see :func:`prepare`)."""

    lib_dir: pathlib.Path
    state_path: pathlib.Path
    counts_path: pathlib.Path | None

    @property
    def env(self) -> dict[str, str]:
        return env(self.lib_dir, self.state_path, self.counts_path)

    def write(self, node: FakeNode) -> pathlib.Path:
        return node.write(self.state_path)

    def counts(self) -> dict[str, int]:
        return read_counts(self.counts_path) if self.counts_path else {}

    def library_cpu_seconds(self) -> float:
        return read_cpu_seconds(self.counts_path) if self.counts_path else 0.0


def prepare(
    workdir: os.PathLike | str,
    node: FakeNode | None = None,
    old_driver: bool = False,
    counts: bool = True,
) -> FakeNvmlEnv:
    """Build the library, write ``node`` (if given) to ``workdir/nvml_state``
    and return a :class:`FakeNvmlEnv` (counts in ``workdir/nvml_counts``, from zero)."""
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if counts:  # a fresh environment counts from zero (the file is shared by the processes using it)
        (workdir / "nvml_counts").unlink(missing_ok=True)
    fx = FakeNvmlEnv(
        lib_dir=build(old_driver),
        state_path=workdir / "nvml_state",
        counts_path=(workdir / "nvml_counts") if counts else None,
    )
    if node is not None:
        fx.write(node)
    return fx


# ---------------------------------------------------------------------------
# Profiles (values from /work/shared/captures, idle)
# ---------------------------------------------------------------------------

# Realistic PCI buses of an 8-GPU HGX board; GPU i uses bus _BUSES[i % 8] in domain i // 8.
_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)

# GPM metrics of an idle Hopper GPU: the ratios 0 %, a little PCIe traffic (MiB/s)
GPM_IDLE = {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0, 5: 0.0, 10: 0.0, 11: 0.0, 12: 0.0, 13: 0.0, 20: 12.5, 21: 8.0}

_ZERO_THROTTLE = {fid: 0 for fid in (74, 75, 76, 77, 78, 79, 269, 270, 271)}


def _identity(profile: str, index: int) -> dict:
    h = hashlib.sha256(f"fakenvml/{profile}/{index}".encode()).hexdigest()
    return dict(
        uuid=f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}",
        pci_bus_id=f"{index // len(_BUSES):08X}:{_BUSES[index % len(_BUSES)]:02X}:00.0",
        serial=f"{int(h[32:44], 16) % 10**13:013d}",
        minor=index,
    )


def _h200(index: int) -> FakeGpu:
    return FakeGpu(
        **_identity("h200", index),
        name="NVIDIA H200",
        vbios="96.00.A5.00.03",
        architecture=9,
        brand=14,
        persistence=1,
        pci_device_id=0x233510DE,
        pci_subsystem_id=0x18BE10DE,
        cuda_cc=(9, 0),
        temperature=28,
        margin_temperature=59,
        memory_temperature=32,
        thresholds={},  # absolute thresholds: NOT_SUPPORTED, use T.Limit fields
        tlimit_thresholds=(-8, -2, 0, 0),
        power_mw=77_670,
        energy_mj=91_234_567,
        power_limit_mw=700_000,
        enforced_power_limit_mw=700_000,
        default_power_limit_mw=700_000,
        power_limit_constraints_mw=(200_000, 700_000),
        pstate=0,
        utilization=(0, 0),
        memory_total=143_771 * MIB,
        memory_reserved=614 * MIB,
        memory_used=0,
        clocks=[345, 345, 3201, 765],
        max_clocks=[1980, 1980, 3201, 1545],
        clocks_event_reasons=0x1,
        supported_clocks_event_reasons=0x1FF,
        pcie_gen=5,
        pcie_width=16,
        pcie_max_gen=5,
        pcie_max_width=16,
        pcie_replay=0,
        ecc_mode=(1, 1),
        ecc_errors={(0, 0): 0, (1, 0): 0, (0, 1): 0, (1, 1): 0},
        remapped_rows=(0, 0, 0, 0),
        retired_pages_pending=None,
        throttle_ns=dict(_ZERO_THROTTLE),
        supported_event_types=EVENT_SBE | EVENT_DBE | EVENT_PSTATE | EVENT_XID | EVENT_MIG_CONFIG,
        # HGX H200 (SXM, 18 NVLinks to the NVSwitches; the capture: 18 links at 26.562 GB/s, fabric
        # Completed / Success, CliqueId 0, ClusterUUID all zero, health N/A): idle, so GPM reads 0 %
        gpm=dict(GPM_IDLE),
        nvlink_states=[1] * 18,
        nvlink_errors={name: [0] * 18 for name in NVLINK_TOTAL_FIELDS},
        nvlink_traffic_kib=(1_234_567, 1_198_765),
        # every link to one of the four NVSwitches of the HGX baseboard
        nvlink_remotes={link: (2, f"00000000:{0x05 + link % 4:02X}:00.0") for link in range(18)},
        fabric=(3, 0, 0, 0),
        fabric_cluster_uuid="0" * 32,
    )


def _b200(index: int) -> FakeGpu:
    """HGX B200 (SXM, Blackwell, 18 NVLink5 links to the NVSwitches), values from NVIDIA's mock B200
    profile (k8s-test-infra): 192 GiB HBM3e, 1,000 W (400-1,200 W), no fans. A real Blackwell driver
    answers the NVLink DL counters (161-163, and the pre-NVLink5 totals) NOT_SUPPORTED: the NVLink5
    counters 206-222 replace them, as device totals (scopeId 0xFFFFFFFF) and per link."""
    g = _h200(index)
    g.__dict__.update(_identity("b200", index))
    g.name = "NVIDIA B200"
    g.vbios = "96.00.A0.00.01"
    g.architecture = 10  # NVML_DEVICE_ARCH_BLACKWELL
    g.pci_device_id, g.pci_subsystem_id = 0x234010DE, 0x181810DE
    g.cuda_cc = (10, 0)
    g.temperature, g.margin_temperature, g.memory_temperature = 35, 50, 33
    g.tlimit_thresholds = (-5, 0, 5, 5)
    g.power_mw, g.energy_mj = 130_000, 900_000
    g.power_limit_mw = g.enforced_power_limit_mw = g.default_power_limit_mw = 1_000_000
    g.power_limit_constraints_mw = (400_000, 1_200_000)
    g.memory_total, g.memory_reserved = 196_608 * MIB, 1024 * MIB
    g.clocks, g.max_clocks = [345, 345, 2500, 1200], [2100, 2100, 2500, 2100]
    g.pcie_gen = g.pcie_max_gen = 6
    g.power_smoothing = {251: 1, 258: 97}
    g.nvlink_errors = {}  # the DL counters: NOT_SUPPORTED on Blackwell
    g.nvlink5_errors = {name: [0] * 18 for name in ("recovery_successful", "recovery_failed", "recovery", "effective",
                                                     "symbol", "malformed_packet", "buffer_overrun", "receive",
                                                     "remote", "general", "local_link_integrity", "transmit_discards")}
    g.nvlink5_ber = {"effective": pack_ber(15, 255), "symbol": pack_ber(15, 255)}
    g.nvlink_traffic_kib = (2_345_678, 2_301_234)
    g.nvlink_remotes = {link: (2, f"00000000:{0x05 + link % 2:02X}:00.0") for link in range(18)}
    return g


def _h100(index: int) -> FakeGpu:
    g = _h200(index)
    g.__dict__.update(_identity("h100", index))
    g.name = "NVIDIA H100 80GB HBM3"
    g.vbios = "96.00.A5.00.01"
    g.pci_device_id = 0x233010DE
    g.pci_subsystem_id = 0x16C110DE
    g.temperature, g.margin_temperature, g.memory_temperature = 41, 46, 48
    g.power_mw = 69_850
    g.memory_total, g.memory_reserved = 81_559 * MIB, 479 * MIB
    g.clocks = [345, 345, 2619, 765]
    g.max_clocks = [1980, 1980, 2619, 1545]
    g.pcie_replay = 9
    return g


def _a100(index: int) -> FakeGpu:
    """HGX A100 40 GB (SXM4, Ampere): 12 NVLink3 links to the NVSwitches, no GPM (Hopper and newer), absolute
    thresholds and no T.Limit margin (Ada and newer), no fabric registration through NVML (Hopper and newer);
    values from NVIDIA's mock A100 profile (k8s-test-infra). Put it on an R535/R550 node (FakeNode.a100)."""
    g = _h200(index)
    g.__dict__.update(_identity("a100", index))
    g.name = "NVIDIA A100-SXM4-40GB"
    g.vbios = "92.00.45.00.03"
    g.architecture = 7
    g.cuda_cc = (8, 0)
    g.pci_device_id, g.pci_subsystem_id = 0x20B010DE, 0x134F10DE
    g.temperature, g.margin_temperature, g.memory_temperature = 33, None, 31
    g.thresholds = {0: 92, 1: 87, 3: 83, 4: 95}  # shutdown, slowdown, gpu max, memory max
    g.tlimit_thresholds = None
    g.power_mw, g.energy_mj = 72_000, 54_321_000
    g.power_limit_mw = g.enforced_power_limit_mw = g.default_power_limit_mw = 400_000
    g.power_limit_constraints_mw = (100_000, 400_000)
    g.memory_total, g.memory_reserved = 40_960 * MIB, 583 * MIB
    g.clocks, g.max_clocks = [210, 210, 1215, 585], [1410, 1410, 1215, 1290]
    g.pcie_gen = g.pcie_max_gen = 4
    g.gpm = None
    g.nvlink_states = [1] * 12
    g.nvlink_errors = {name: [0] * 12 for name in NVLINK_TOTAL_FIELDS}
    g.nvlink_remotes = {link: (2, f"00000000:{0xC4 + link % 6:02X}:00.0") for link in range(12)}
    g.fabric = None
    g.fabric_cluster_uuid = None
    return g


def _rtx4090(index: int) -> FakeGpu:
    """GeForce RTX 4090 (Ada, AD102): two fans, absolute thresholds, no ECC, row remapping, NVLink, GPM or MIG;
    the RTX 4080 SUPER capture's behaviour with the 4090's board values (24 GB GDDR6X, 450 W, 150-600 W)."""
    g = _rtx4080s(index)
    g.__dict__.update(_identity("rtx4090", index))
    g.name = "NVIDIA GeForce RTX 4090"
    g.vbios = "95.02.18.80.87"
    g.pci_device_id, g.pci_subsystem_id = 0x268410DE, 0x16F310DE
    g.power_mw = 31_400
    g.power_limit_mw = g.enforced_power_limit_mw = g.default_power_limit_mw = 450_000
    g.power_limit_constraints_mw = (150_000, 600_000)
    g.memory_total, g.memory_reserved, g.memory_used = 24_564 * MIB, 470 * MIB, 0
    g.max_clocks = [3120, 3120, 10501, 2415]
    g.thresholds = {0: 97, 1: 94, 3: 90, 5: 84}
    return g


def _h100_mig(index: int) -> FakeGpu:
    """An H100 in MIG mode with the capture's four instances (3g.40gb, 2g.20gb, 1g.10gb, 1g.10gb): the
    parent has no utilization and no remapped rows (NVML: not supported with MIG on), GPM per instance."""
    g = _h100(index)
    g.__dict__.update(_identity("h100-mig", index))
    g.utilization = None
    g.encoder_utilization = g.decoder_utilization = None
    g.remapped_rows = None
    g.mig_mode = (1, 1)
    mib = MIB
    h = hashlib.sha256(f"fakenvml/h100-mig/{index}/mig".encode()).hexdigest()
    layout = ((2, "3g.40gb", 40448, 26), (3, "2g.20gb", 20096, 17), (9, "1g.10gb", 9984, 9), (10, "1g.10gb", 9984, 9))
    g.mig_devices = {
        slot: FakeMig(gpu_instance=gi, compute_instance=0, total=total * mib, used=used * mib,
                      uuid=f"MIG-{h[slot * 8:slot * 8 + 8]}-{h[32:36]}-{h[36:40]}-{h[40:44]}-{h[44:56]}",
                      name=f"NVIDIA H100 80GB HBM3 MIG {profile}", gpm={2: 0.0, 5: 0.0, 10: 0.0})
        for slot, (gi, profile, total, used) in enumerate(layout)}
    return g


def _gh200(index: int) -> FakeGpu:
    """A GH200 480GB's GPU (H100-class, 96 GB HBM3) in a Grace Hopper superchip without NVSwitch. No
    capture is on file: the values are the H200 capture's where the boards agree, the module's published
    ones otherwise, and 10 C2C links at 44,712 MB/s (NVLink-C2C's 450 GB/s a direction; assumed)."""
    g = _h200(index)
    g.__dict__.update(_identity("gh200", index))
    g.name = "NVIDIA GH200 480GB"
    g.vbios = "96.00.74.00.01"
    g.pci_device_id, g.pci_subsystem_id = 0x234210DE, 0x16EB10DE
    g.temperature, g.margin_temperature, g.memory_temperature = 29, 58, 33
    g.power_mw, g.module_power_mw = 90_120, 201_350
    g.energy_mj = 123_456_789  # module-scoped: GPU + Grace + memory
    g.power_limit_mw = g.enforced_power_limit_mw = g.default_power_limit_mw = 900_000
    g.power_limit_constraints_mw = (200_000, 900_000)
    g.memory_total, g.memory_reserved = 97_871 * MIB, 576 * MIB
    g.clocks, g.max_clocks = [345, 345, 2619, 765], [1980, 1980, 2619, 1545]
    g.nvlink_states, g.nvlink_errors, g.nvlink_traffic_kib, g.nvlink_remotes = [], {}, None, {}
    g.fabric = g.fabric_cluster_uuid = None
    _grace_coupled(g)
    return g


def _gb200(index: int) -> FakeGpu:
    """A GB200's GPU after NVIDIA's mock configuration (k8s-test-infra mock-nvml-config-gb200.yaml):
    Blackwell, 192 GiB HBM3e, 1,000 W (400-1,200 W), 145 W and 36 C idle, liquid cooled (no fans), 18
    NVLink5 links to 4 NVSwitches (the NVLink5 counters, as the B200's; no DL counters), fabric completed, C2C
    on, power smoothing; put on an R580.65 driver by FakeNode.gb200 (throttle counters at 251-253)."""
    g = _b200(index)  # Blackwell, the B200's memory, limits, clocks, PCIe gen 6 and NVLink5 counters
    g.__dict__.update(_identity("gb200", index))
    g.name = "NVIDIA GB200"
    g.vbios = "96.00.9E.00.01"
    g.pci_device_id, g.pci_subsystem_id = 0x233010DE, 0x181710DE
    g.temperature, g.margin_temperature, g.memory_temperature = 36, 49, 34
    g.tlimit_thresholds = (-10, -5, 0, 0)  # shutdown 95, slowdown 90, max operating 85 C
    g.power_mw, g.module_power_mw = 145_000, 262_500
    g.energy_mj = 234_567_890
    g.nvlink_traffic_kib = (1_234_567, 1_198_765)
    g.nvlink_remotes = {link: (2, f"00000000:{0x01 + link % 4:02X}:00.0") for link in range(18)}
    g.fabric_cluster_uuid = "0" * 31 + "1"
    g.power_smoothing = {251: 1, 258: 92}
    _grace_coupled(g)
    return g


def _grace_coupled(g: FakeGpu) -> None:
    g.c2c_mode = 1
    g.c2c_links = [1] * 10
    g.c2c_max_bw_mbps = 44_712
    g.c2c_errors = {"crc": 0, "replay": 0, "replay_b2b": 0}
    g.c2c_power_state = [0] * 10


def _l40s(index: int) -> FakeGpu:
    return FakeGpu(
        **_identity("l40s", index),
        name="NVIDIA L40S",
        vbios="95.02.66.00.02",
        architecture=8,
        brand=14,
        persistence=1,
        pci_device_id=0x26B910DE,
        pci_subsystem_id=0x185110DE,
        cuda_cc=(8, 9),
        temperature=64,
        margin_temperature=24,
        memory_temperature=None,  # GDDR
        thresholds={},
        tlimit_thresholds=(-5, -2, None, 0),
        power_mw=144_970,
        energy_mj=48_000_000,
        power_limit_mw=350_000,
        enforced_power_limit_mw=350_000,
        default_power_limit_mw=350_000,
        power_limit_constraints_mw=(100_000, 350_000),
        pstate=0,
        utilization=(0, 0),
        memory_total=46_068 * MIB,
        memory_reserved=609 * MIB,
        memory_used=0,
        clocks=[2520, 2520, 9001, 1965],
        max_clocks=[2520, 2520, 9001, 1965],
        clocks_event_reasons=0x0,
        supported_clocks_event_reasons=0x1FF,
        pcie_gen=4,
        pcie_width=16,
        pcie_max_gen=4,
        pcie_max_width=16,
        pcie_replay=0,
        ecc_mode=(1, 1),
        ecc_errors={(0, 0): 0, (1, 0): 0, (0, 1): 0, (1, 1): 0},
        remapped_rows=(0, 0, 0, 0),
        retired_pages_pending=None,
        throttle_ns=dict(_ZERO_THROTTLE),
        supported_event_types=EVENT_SBE | EVENT_DBE | EVENT_PSTATE | EVENT_XID,
    )


def _rtx4080s(index: int) -> FakeGpu:
    return FakeGpu(
        **_identity("rtx", index),
        name="NVIDIA GeForce RTX 4080 SUPER",
        vbios="95.03.44.00.B2",
        architecture=8,
        brand=5,
        persistence=0,
        pci_device_id=0x270210DE,
        pci_subsystem_id=0x51101462,
        cuda_cc=(8, 9),
        temperature=43,
        margin_temperature=None,
        memory_temperature=None,
        thresholds={0: 101, 1: 96, 3: 90, 5: 84},  # shutdown, slowdown, gpu max, acoustic (target)
        tlimit_thresholds=None,
        fan_speeds=[38, 38],
        fan_targets=[38, 38],
        fan_rpms=[1500, 1530],
        power_mw=26_200,
        energy_mj=12_345_678,
        power_limit_mw=320_000,
        enforced_power_limit_mw=320_000,
        default_power_limit_mw=320_000,
        power_limit_constraints_mw=(150_000, 400_000),
        pstate=8,
        utilization=(0, 23),
        memory_total=16_376 * MIB,
        memory_reserved=434 * MIB,
        memory_used=596 * MIB,
        clocks=[210, 210, 405, 1185],
        max_clocks=[3165, 3165, 11501, 2415],
        clocks_event_reasons=0x1,
        supported_clocks_event_reasons=0x1FF,
        pcie_gen=1,
        pcie_width=16,
        pcie_max_gen=4,
        pcie_max_width=16,
        pcie_replay=0,
        ecc_mode=None,
        ecc_errors=None,
        remapped_rows=None,
        retired_pages_pending=None,
        throttle_ns=dict(_ZERO_THROTTLE),
        supported_event_types=EVENT_PSTATE | EVENT_XID,
    )


def _rtx2080s(index: int) -> FakeGpu:
    g = _rtx4080s(index)
    g.__dict__.update(_identity("rtx2080s", index))
    g.name = "NVIDIA GeForce RTX 2080 SUPER"
    g.vbios = "90.04.7A.40.73"
    g.architecture = 6
    g.pci_device_id, g.pci_subsystem_id = 0x1E8110DE, 0x40051458
    g.cuda_cc = (7, 5)
    g.temperature = 40
    g.thresholds = {0: 100, 1: 97, 3: 89, 5: 84}
    g.power_mw = 37_620
    g.power_limit_mw = g.enforced_power_limit_mw = g.default_power_limit_mw = 250_000
    g.power_limit_constraints_mw = (105_000, 350_000)
    g.utilization = (0, 9)
    g.memory_total, g.memory_reserved, g.memory_used = 8192 * MIB, 408 * MIB, 214 * MIB
    g.clocks = [300, 300, 405, 540]
    g.max_clocks = [2145, 2145, 7751, 1995]
    g.pcie_max_gen = 3
    return g


PROFILES = {
    "h200": _h200,
    "h100": _h100,
    "b200": _b200,
    "a100": _a100,
    "rtx4090": _rtx4090,
    "h100-mig": _h100_mig,
    "gh200": _gh200,
    "gb200": _gb200,
    "l40s": _l40s,
    "rtx": _rtx4080s,
    "rtx4080s": _rtx4080s,
    "rtx2080s": _rtx2080s,
}


def make_gpu(profile: str, index: int = 0) -> FakeGpu:
    """A fresh FakeGpu of ``profile`` (a :data:`PROFILES` key) with identity
    (UUID, PCI bus id, serial, minor) unique to ``index``."""
    try:
        factory = PROFILES[profile]
    except KeyError:
        raise ValueError(f"unknown profile {profile!r}; known: {sorted(PROFILES)}") from None
    return factory(index)
