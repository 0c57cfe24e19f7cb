"""NVML's return codes, mapped to outcomes: unsupported, a lost GPU, the backend gone (with hints)."""

from __future__ import annotations

import ctypes
import os

import pynvml as N

from gpuwatch.errors import BackendUnavailable, DeviceLost
from gpuwatch.logs import get_logger

ERROR_NAMES: dict[int, str] = {
    getattr(N, name): name[len("NVML_ERROR_"):].lower()
    for name in dir(N)
    if name.startswith("NVML_ERROR_") and isinstance(getattr(N, name), int)
}
UNSUPPORTED = {
    N.NVML_ERROR_NOT_SUPPORTED,
    N.NVML_ERROR_INVALID_ARGUMENT,
    N.NVML_ERROR_NO_PERMISSION,
    N.NVML_ERROR_FUNCTION_NOT_FOUND,
    getattr(N, "NVML_ERROR_DEPRECATED", 26),
}
LOST = N.NVML_ERROR_GPU_IS_LOST
BACKEND_GONE = {
    N.NVML_ERROR_UNINITIALIZED: (
        "uninitialized", "NVML lost its initialisation; gpuwatch re-initialises it by itself"),
    N.NVML_ERROR_DRIVER_NOT_LOADED: (
        "driver_not_loaded",
        "the nvidia kernel module is not loaded: check `lsmod | grep nvidia` and `dmesg`, load it with "
        "`modprobe nvidia`; gpuwatch keeps retrying"),
    N.NVML_ERROR_LIBRARY_NOT_FOUND: (
        "library_not_found",
        "libnvidia-ml.so.1 cannot be loaded: install the NVIDIA driver (in a container: the NVIDIA container "
        "toolkit), or run `gpuwatch demo` for a simulated node"),
    N.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        "driver_version_mismatch",
        "the NVIDIA driver was upgraded without a reboot: libnvidia-ml.so and the kernel module differ; "
        "reboot the node (or reload the nvidia kernel modules)"),
    N.NVML_ERROR_NO_PERMISSION: (
        "no_permission",
        "no access to /dev/nvidiactl: run gpuwatch as a user that may open the NVIDIA device nodes"),
}

LIBRARY = "libnvidia-ml.so.1"  # what pynvml loads on Linux

def copied_symlink() -> tuple[str, str] | None:
    """(path, the library it names) for a libnvidia-ml.so.1 on LD_LIBRARY_PATH that is no library but a few
    bytes of text naming one beside it: a symlink copied as a file (a tarball or a copy tool that does not
    keep links; NVIDIA's mock arrives so in shared/)."""
    for directory in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)):
        path = os.path.join(directory, LIBRARY)
        try:
            if not os.path.isfile(path) or os.path.islink(path) or os.path.getsize(path) > 255:
                continue
            with open(path, "rb") as stub:
                target = stub.read().decode("utf-8", "replace").strip()
        except OSError:
            continue
        if target and "/" not in target and os.path.isfile(os.path.join(directory, target)):
            return path, os.path.join(os.path.abspath(directory), target)
    return None


def copied_symlink_hint() -> str | None:
    """How to mend a libnvidia-ml.so.1 copied as a text file (copied_symlink), or None."""
    found = copied_symlink()
    if found is None:
        return None
    path, real = found
    return (f"{path} is not a library but a text file naming {os.path.basename(real)}: a symlink copied as a "
            f"file. Link it in a directory of your own (`mkdir -p /tmp/nvml && ln -sf {real} /tmp/nvml/{LIBRARY}`) "
            "and put that directory first on LD_LIBRARY_PATH")


def follow_copied_symlink() -> bool:
    """Load the library that a libnvidia-ml.so.1 copied as a text file names, as the link would have: pynvml's
    next load of libnvidia-ml.so.1 then finds it loaded (its soname). Logged with how to mend the copy. False
    where there is no such file or what it names does not load."""
    found = copied_symlink()
    if found is None:
        return False
    path, real = found
    try:
        ctypes.CDLL(real, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return False
    get_logger(component="nvml").warning("nvml_library_copied_symlink", path=path, library=real,
                                         hint=copied_symlink_hint())
    return True


def is_gone(code: int) -> bool:
    """GPU_IS_LOST or the backend as a whole went away: errors that must not be taken for "unsupported"."""
    return code == LOST or (code in BACKEND_GONE and code != N.NVML_ERROR_NO_PERMISSION)



def unavailable(exc: N.NVMLError) -> BackendUnavailable:
    """BackendUnavailable for an error that took the whole backend away, with its hint."""
    reason, hint = BACKEND_GONE.get(
        exc.value, (ERROR_NAMES.get(exc.value, "unknown"), "check `nvidia-smi`; gpuwatch keeps retrying"))
    if exc.value == N.NVML_ERROR_LIBRARY_NOT_FOUND:
        copied = copied_symlink_hint()
        hint = f"{copied}; gpuwatch keeps retrying" if copied else hint
    return BackendUnavailable(reason, f"NVML: {exc}", hint)


def failure(exc: N.NVMLError, uuid: str) -> Exception | None:
    """An error raised while polling as DeviceLost / BackendUnavailable; None for the others (that
    reading is absent from this poll, its error counted)."""
    if exc.value == LOST:
        return DeviceLost(uuid, f"NVML: {exc}")
    if exc.value in BACKEND_GONE and exc.value != N.NVML_ERROR_NO_PERMISSION:
        return unavailable(exc)
    return None
