"""Which reading groups are on, and their options: the one place ``--collector.<group>`` and
``--collector.<group>.<option>`` are applied.

A Selection is built once from the configuration (gpuwatch/agent.py) and given to every part that
reads or renders groups: the backends (the NVML backend probes and reads only the selected groups,
with their options; the simulator, a replay and the scripted backend leave the others' readings at
their empty defaults), the poller (which groups' times and successes it counts, whether an events
thread runs), the host reader and the exporter. What the engine (poller, NVML backend, exporter,
agent) needs to know about a group is a property of the group's declaration (``Group.events``,
``Group.attributed``, ``Group.host``, ...), never its name; the host reader, the host groups' backend,
builds each host group's reader by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from gpuwatch.groups.base import Group
from gpuwatch.groups.joint import JOINT, Joint


@dataclasses.dataclass(frozen=True, eq=False)
class Selection:
    enabled: frozenset[str]
    options: Mapping[str, Any]  # "<group>.<option>" -> value, every option of every group (defaults filled in)
    groups: tuple[Group, ...] = dataclasses.field(init=False)  # the selected groups, in the registry's order
    everything: bool = dataclasses.field(init=False)  # every group is selected
    # sample type -> (attribute, empty default) of each unselected group with a reading in it (narrow)
    _unselected: dict[type, tuple[tuple[str, Any], ...]] = dataclasses.field(init=False, repr=False)

    @classmethod
    def of(cls, enabled: Iterable[str] | None = None, options: Mapping[str, Any] | None = None) -> Selection:
        from gpuwatch.groups import DEFAULT_ENABLED, GROUPS  # the registry imports this module

        full = {f"{g.name}.{name}": default for g in GROUPS for name, (default, _) in g.options.items()}
        full.update(options or {})
        return cls(frozenset(DEFAULT_ENABLED if enabled is None else enabled), MappingProxyType(full))

    def __post_init__(self) -> None:
        from gpuwatch.groups import ALL, GROUPS

        object.__setattr__(self, "groups", tuple(g for g in GROUPS if g.name in self.enabled))
        object.__setattr__(self, "everything", self.enabled >= ALL)
        object.__setattr__(self, "_unselected", {})

    def __contains__(self, name: object) -> bool:
        return name in self.enabled

    def option(self, group: str, name: str) -> Any:
        return self.options[f"{group}.{name}"]

    def options_of(self, group: str) -> dict[str, Any]:
        """The options of one group, by their names after ``<group>.``."""
        prefix = group + "."
        return {key[len(prefix):]: value for key, value in self.options.items() if key.startswith(prefix)}

    @property
    def features(self) -> frozenset[str]:
        return frozenset(f for g in self.groups for f in g.features)

    def tier(self, tier: str) -> tuple[str, ...]:
        """The selected groups with a reading in ``tier`` ("fast" or "slow")."""
        return tuple(g.name for g in self.groups if getattr(g, tier))

    @property
    def host(self) -> tuple[Group, ...]:
        """The selected host groups (read on the host, not through NVML)."""
        return tuple(g for g in self.groups if g.host)

    @property
    def events(self) -> bool:
        """Whether a selected group reads NVML events (the poller's events thread runs then)."""
        return any(g.events for g in self.groups)

    @property
    def attributed(self) -> tuple[str, ...]:
        """The selected groups whose slow reading is attributed to jobs through /proc (the time it takes is theirs)."""
        return tuple(g.name for g in self.groups if g.attributed)

    @property
    def joint(self) -> tuple[Joint, ...]:
        """The joint families' units (groups/joint.py) of which a group is selected."""
        return tuple(j for j in JOINT if j.of & self.enabled)

    @property
    def per_pid_max(self) -> int:
        """How many per-process series the node may export (0: none)."""
        return max((int(self.option(g.name, "per-pid-max")) for g in self.groups
                    if "per-pid" in g.options and self.option(g.name, "per-pid")), default=0)

    def narrow(self, sample: Any) -> Any:
        """A backend's sample with the readings of groups that are not selected at their empty defaults.

        Runs on every GPU's sample of every poll: the unselected groups' attributes and defaults are worked
        out once per sample type, and a sample that holds nothing of them (the NVML backend's, which reads
        the selected groups only) is returned as it is, without a copy."""
        if self.everything:
            return sample
        unselected = self._unselected.get(type(sample))
        if unselected is None:
            from gpuwatch.groups import unselected_defaults

            unselected = self._unselected[type(sample)] = unselected_defaults(type(sample), self.enabled)
        changes = {attr: default for attr, default in unselected if getattr(sample, attr) is not default}
        return dataclasses.replace(sample, **changes) if changes else sample
