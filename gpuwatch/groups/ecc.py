"""ecc: ECC error counts and the memory repair states (row remapping, page retirement).

Slow tier, all from the tier's one field-values batch: ECC totals (fields 3-6), row remapping
(142-145, Ampere and newer), pending page retirement (31, Volta and older). These are facts the
driver counts, not measurements: the rules fire on the first poll that shows them. So every value
passes ``Query.plausible`` first: an ECC count outside 0..MAX_COUNTER (2**64-1, -1 in a signed field), a
remapped-row count outside 0..MAX_COUNTER32 (0xFFFFFFFF), a flag other than 0 or 1, NaN or a fraction is
left out (no rule fires on it), counted (implausible_value) and logged once; the other readings stay.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuwatch.groups.base import MAX_COUNTER, MAX_COUNTER32, Device, Emit, G, Group, Query, Spec, counted

_ECC = {3: ("corrected", "volatile"), 4: ("uncorrected", "volatile"),
        5: ("corrected", "aggregate"), 6: ("uncorrected", "aggregate")}  # NVML_FI_DEV_ECC_{SBE,DBE}_{VOL,AGG}_TOTAL
_REMAP = {142: "correctable", 143: "uncorrectable"}  # NVML_FI_DEV_REMAPPED_COR / _UNC
_REMAP_PENDING, _REMAP_FAILED, _RETIRED_PENDING = 144, 145, 31
_ECC_NAMES = {fid: f"ECC {e} {c}" for fid, (e, c) in _ECC.items()}  # the readings' names (Group.fields, plausible)
_REMAP_NAMES = {fid: f"{k} remapped rows" for fid, k in _REMAP.items()}
_FLAGS = {_REMAP_PENDING: "remap pending", _REMAP_FAILED: "remap failure", _RETIRED_PENDING: "retirement pending"}


@dataclass(frozen=True, slots=True)
class Ecc:
    ecc_errors: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (error, counter) -> count
    remapped_rows: Mapping[str, int] = field(default_factory=dict)  # correctable | uncorrectable
    remapped_rows_pending: bool | None = None
    remapped_rows_failed: bool | None = None
    retired_pages_pending: bool | None = None


class Nvml:
    def __init__(self, dev: Device) -> None:
        self.ecc = tuple((fid, key) for fid, key in _ECC.items() if dev.field(fid, "slow"))
        self.remap = tuple((fid, key) for fid, key in _REMAP.items() if dev.field(fid, "slow"))
        self.pending = dev.field(_REMAP_PENDING, "slow")
        self.failed = dev.field(_REMAP_FAILED, "slow")
        self.retired = dev.field(_RETIRED_PENDING, "slow")
        dev.feature("ecc", bool(self.ecc))
        dev.feature("remapped_rows", bool(self.remap) or self.pending or self.failed)
        dev.feature("retired_pages", self.retired)

    def read_fast(self, q: Query) -> None:
        return None

    def read_slow(self, q: Query) -> Ecc:
        def flag(fid: int, wanted: bool) -> bool | None:
            value = counted(q, q.field(fid), 1, _FLAGS[fid]) if wanted else None
            return None if value is None else bool(value)

        ecc = {key: n for fid, key in self.ecc
               if (n := counted(q, q.field(fid), MAX_COUNTER, _ECC_NAMES[fid])) is not None}
        remap = {key: n for fid, key in self.remap
                 if (n := counted(q, q.field(fid), MAX_COUNTER32, _REMAP_NAMES[fid])) is not None}
        return Ecc(ecc, remap, flag(_REMAP_PENDING, self.pending), flag(_REMAP_FAILED, self.failed),
                   flag(_RETIRED_PENDING, self.retired))


def render(emit: Emit, fast: None, slow: Ecc | None) -> None:
    if slow is None:
        return
    for (error, counter), count in slow.ecc_errors.items():
        emit("gpuwatch_ecc_errors_total", (error, counter), count)
    for error, count in slow.remapped_rows.items():
        emit("gpuwatch_remapped_rows_total", (error,), count)
    emit("gpuwatch_remapped_rows_pending", (), slow.remapped_rows_pending)
    emit("gpuwatch_remapped_rows_failed", (), slow.remapped_rows_failed)
    emit("gpuwatch_retired_pages_pending", (), slow.retired_pages_pending)


GROUP = Group(
    name="ecc",
    help="ECC error counts, row remapping and page retirement",
    features=("ecc", "remapped_rows", "retired_pages"),
    slow="ecc",
    nvml=Nvml,
    fields={fid: name for names in (_ECC_NAMES, _REMAP_NAMES, _FLAGS) for fid, name in names.items()},
    render=render,
    specs=(
        Spec("gpuwatch_ecc_errors_total", "counter", G + ("error", "counter"),
             "ECC error counts: corrected/uncorrected, volatile (since driver load) or aggregate (lifetime) "
             "(fields NVML_FI_DEV_ECC_{SBE,DBE}_{VOL,AGG}_TOTAL; 'ECC Errors')."),
        Spec("gpuwatch_remapped_rows_total", "counter", G + ("error",),
             "Memory rows remapped because of correctable/uncorrectable errors (fields NVML_FI_DEV_REMAPPED_*; "
             "'Remapped Rows')."),
        Spec("gpuwatch_remapped_rows_pending", "gauge", G, "1 when a row remap waits for a GPU reset ('Pending')."),
        Spec("gpuwatch_remapped_rows_failed", "gauge", G,
             "1 when a row remap failed: the GPU needs service ('Remapping Failure Occurred')."),
        Spec("gpuwatch_retired_pages_pending", "gauge", G,
             "1 when page retirement waits for a reboot (field NVML_FI_DEV_RETIRED_PENDING; "
             "'Pending Page Blacklist')."),
    ),
)
