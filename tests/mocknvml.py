"""NVIDIA's mock NVML (``../shared/mocknvml``) for the tests: an NVML this project did not write.

The mock is NVIDIA's ``libnvidia-ml.so`` from NVIDIA/k8s-test-infra (``pkg/gpu/mocknvml``): a cgo
library that serves the GPUs of a YAML profile (``configs/*.yaml``; ``MOCK_NVML_CONFIG`` names the
one to load). It lives beside the repository (``<checkout>/../shared/mocknvml``; the environment
variable ``GPUWATCH_MOCKNVML`` names another place); without it the tests that need it skip, saying
where it was looked for.

What the mock answers is a function of its profile, so the tests compute what gpuwatch must export
from the YAML (:class:`Profile`) instead of writing numbers down per profile. The merge of
``device_defaults`` with the per-device entries, the NVLink links synthesised from the switches and
the GPU count follow the mock's engine (``engine/config.go`` ``mergeDeviceOverride``,
``engine/topology.go`` ``resolveLinks``, ``engine/config.go`` ``applyYAMLConfig``).
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from daemon import isolated_env

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = "libnvidia-ml.so.1"


def location() -> Path:
    """Where the mock is looked for: ``$GPUWATCH_MOCKNVML``, else ``shared/mocknvml`` beside the checkout."""
    override = os.environ.get("GPUWATCH_MOCKNVML")
    return Path(override) if override else ROOT.parent / "shared" / "mocknvml"


def missing() -> str | None:
    """Why the mock cannot be used (a skip reason), or None when it can."""
    where = location()
    if not where.is_dir():
        return (f"NVIDIA's mock NVML is not at {where} (put a copy of shared/mocknvml beside the checkout, "
                "or set GPUWATCH_MOCKNVML to its folder)")
    if not sorted((where / "configs").glob("*.yaml")):
        return f"NVIDIA's mock NVML at {where} has no profile in configs/"
    try:
        real_library(where / "lib")
    except FileNotFoundError as exc:
        return f"NVIDIA's mock NVML at {where}: {exc}"
    return None


def profile_paths() -> list[Path]:
    """Every profile the mock ships (none when it is absent): a new profile is tested without a change here."""
    return sorted((location() / "configs").glob("*.yaml")) if missing() is None else []


def real_library(lib: Path, name: str = LIBRARY) -> Path:
    """The shared object ``lib/name`` stands for. The shared copy's symbolic links may arrive as small
    text files naming their target (``libnvidia-ml.so.1`` holding ``libnvidia-ml.so.550.163.01``):
    those are followed like links, within ``lib``."""
    path = lib / name
    for _ in range(8):
        if not path.exists():
            raise FileNotFoundError(f"no {path}")
        path = path.resolve()
        with open(path, "rb") as f:
            head = f.read(256)
        if head.startswith(b"\x7fELF"):
            return path
        target = head.decode("ascii", "replace").strip()
        if len(head) >= 256 or not target or "/" in target or "\n" in target:
            raise FileNotFoundError(f"{path} is neither a shared object nor a file naming one")
        path = lib / target
    raise FileNotFoundError(f"{lib / name}: too many indirections")


def library_dir(workdir: Path) -> Path:
    """A folder holding ``libnvidia-ml.so.1`` as a link to the mock's shared object (for LD_LIBRARY_PATH)."""
    out = workdir / "mocknvml-lib"
    out.mkdir(parents=True, exist_ok=True)
    link = out / LIBRARY
    if not link.is_symlink():
        link.symlink_to(real_library(location() / "lib"))
    return out


def env(lib_dir: Path, config: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a gpuwatch over the mock serving profile file ``config``.

    ``MOCK_NVML_EPOCH`` (the time the mock's NVLink counters accrue from; else the boot time) is now,
    so the counters start near 0; the mock's other environment settings are removed."""
    out = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("MOCK_NVML_")}
    old = out.get("LD_LIBRARY_PATH")
    out["LD_LIBRARY_PATH"] = str(lib_dir) + (os.pathsep + old if old else "")
    out["MOCK_NVML_CONFIG"] = str(config)
    out["MOCK_NVML_EPOCH"] = str(int(time.time()))
    return isolated_env(out)


# ------------------------------------------------------------------------------------ profiles

#: device keys a per-device entry replaces as a whole block (mergeDeviceOverride); scalars below
#: replace when non-empty, ``pci`` merges field by field; any other key of a device entry is ignored
# libyaml's parser when PyYAML has it (the same documents as safe_load, several times faster: the profiles
# are read when the tests are collected)
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_BLOCKS = ("memory", "bar1_memory", "power", "thermal", "clocks", "clocks_throttle_reasons", "utilization",
           "ecc", "dynamic_metrics", "failure", "fabric", "nvlink_error", "processes")
_SCALARS = ("name", "serial", "brand", "board_part_number", "vbios_version", "architecture")
_NVLINK_MAX_LINKS = 18  # the mock's nvLinkMaxLinks


@dataclass
class Profile:
    path: Path
    doc: dict[str, Any]

    @classmethod
    def load(cls, path: Path) -> Profile:
        return cls(path, yaml.load(path.read_text(), Loader=SAFE_LOADER))

    @property
    def name(self) -> str:
        return self.path.stem.removeprefix("mock-nvml-config-")

    @property
    def driver_version(self) -> str:
        return str(self.doc["system"]["driver_version"])

    @property
    def count(self) -> int:
        """GPUs the mock serves: ``system.num_devices``, else the device entries, else 8."""
        return int(self.doc["system"].get("num_devices") or len(self.doc.get("devices") or ()) or 8)

    def entry(self, index: int) -> dict[str, Any]:
        return next((d for d in self.doc.get("devices") or () if d.get("index") == index), {})

    def device(self, index: int) -> dict[str, Any]:
        """The configuration the mock gives GPU ``index``: the defaults with the device's entry merged."""
        merged = copy.deepcopy(self.doc.get("device_defaults") or {})
        entry = self.entry(index)
        for key in _SCALARS:
            if entry.get(key):
                merged[key] = entry[key]
        if entry.get("pci"):
            pci = merged.setdefault("pci", {})
            pci.update({k: v for k, v in entry["pci"].items() if v})
        for key in _BLOCKS:
            if entry.get(key) is not None:
                merged[key] = copy.deepcopy(entry[key])
        merged["uuid"] = entry.get("uuid")
        merged["minor_number"] = entry.get("minor_number", 0)
        return merged

    def links(self, index: int) -> tuple[int, int]:
        """(links, active links) of GPU ``index``: the device's own ``nvlink.device_links`` (or
        ``nvlink.links`` for GPU 0), else ``links_per_gpu`` links fanned over the declared switches,
        else none (topology.go resolveLinks)."""
        nv = self.doc.get("nvlink") or {}
        default_state = (nv.get("defaults") or {}).get("state") or ""
        own = next((d.get("links") for d in nv.get("device_links") or () if d.get("index") == index), None)
        if own is None and index == 0 and nv.get("links"):
            own = nv["links"]
        if own is None:
            if not nv.get("switches") or not nv.get("links_per_gpu"):
                return 0, 0
            own = [{} for _ in range(min(int(nv["links_per_gpu"]), _NVLINK_MAX_LINKS))]
        active = sum(1 for link in own if _active(link.get("state") or default_state))
        return len(own), active

    @property
    def nvlink_version(self) -> int:
        return int((self.doc.get("nvlink") or {}).get("version") or 0)

    @property
    def c2c(self) -> bool:
        return bool((self.doc.get("nvlink") or {}).get("c2c_enabled"))

    def with_devices(self, changes: dict[int, dict[str, Any]]) -> Profile:
        """A copy whose device entries get ``changes[index]`` added (the mock's fault injection:
        ``failure``, ``nvlink_error``)."""
        doc = copy.deepcopy(self.doc)
        for index, change in changes.items():
            entry = next((d for d in doc.setdefault("devices", []) if d.get("index") == index), None)
            if entry is None:
                entry = {"index": index}
                doc["devices"].append(entry)
            entry.update(copy.deepcopy(change))
        return Profile(self.path, doc)

    def write(self, folder: Path) -> Path:
        """The profile as a file of its own in ``folder`` (the mock also reads an ``overrides.yaml``
        next to its profile: none there)."""
        folder.mkdir(parents=True, exist_ok=True)
        out = folder / self.path.name
        out.write_text(yaml.dump(self.doc, Dumper=_Dumper, sort_keys=False))
        return out


class _Dumper(yaml.SafeDumper):
    """Every string quoted: the mock reads YAML 1.2, where an unquoted 0421819085400 (a T4 serial, plain
    to PyYAML's YAML 1.1) is a number, and then falls back to its 8 default GPUs."""


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style='"'))


def _active(state: str) -> bool:
    return state == "" or state.strip().lower() in ("active", "up", "enabled")  # topology.go nvlinkStateActive
