"""Which pod holds which GPU on a Kubernetes node: the kubelet's PodResources API (v1).

The kubelet serves the gRPC service ``v1.PodResourcesLister`` on a unix socket, by default
``/var/lib/kubelet/pod-resources/kubelet.sock``. Its ``List`` call returns every pod on the node with, for each
container, the device ids the device plugins gave it. :class:`PodResourcesClient` makes that call and keeps what
NVIDIA's device plugin hands out (resources ``nvidia.com/gpu``, ``nvidia.com/mig-<profile>``,
``nvidia.com/gpu.shared``, ...) as :class:`PodDevice` rows, as dcgm-exporter does to attribute GPUs to pods.

grpcio and protobuf are the optional extra ``gpuwatch[kubernetes]`` (the generated code is in
``gpuwatch.hostside.podresources``): they are imported on the first call, so this module imports without them,
and the client then fails with reason ``no_grpcio``. Every failure is a :class:`KubeletUnavailable` with a stable
reason and a hint the operator can act on.
"""

from __future__ import annotations

import os
import re
import stat
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from gpuwatch.errors import GpuwatchError

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
DEFAULT_TIMEOUT = 5.0
RESOURCE_PREFIX = "nvidia.com/"
# What the kubelet's own podresources client accepts (pkg/kubelet/apis/podresources: 16 MiB); gRPC's default of
# 4 MiB can be too little for a List on a node with many pods.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

# NVIDIA's device plugin with time-slicing or MPS (and renameByDefault off) advertises each GPU N times, as
# "<id>::0" ... "<id>::N-1"; the GPU is "<id>".
_SHARING_SUFFIX = re.compile(r"::[0-9]+\Z")  # ASCII digits, at the very end ($ also matched before a newline)

_INSTALL_HINT = "install the kubernetes extra: pip install 'gpuwatch[kubernetes]' (grpcio and protobuf)"
_UPGRADE_HINT = (
    "upgrade grpcio and protobuf to what the generated code in gpuwatch.hostside.podresources needs: "
    "pip install -U 'gpuwatch[kubernetes]'"
)
_MOUNT_HINT = (
    "on Kubernetes, mount the kubelet's pod-resources directory (hostPath /var/lib/kubelet/pod-resources) "
    "read-only into the gpuwatch container; a kubelet with another --root-dir keeps the socket under it"
)
_USER_HINT = (
    "run gpuwatch as a user that may connect to the socket (the kubelet creates it owned by root: "
    "connecting needs write permission on it)"
)


@dataclass(frozen=True, slots=True)
class PodDevice:
    """One device that the kubelet says a container holds."""

    namespace: str
    pod: str
    container: str
    resource: str  # e.g. "nvidia.com/gpu", "nvidia.com/mig-1g.10gb"
    device_id: str  # as the kubelet gives it, with a device plugin sharing suffix "::N" removed


class KubeletUnavailable(GpuwatchError):
    """The kubelet's PodResources API cannot be read now.

    ``reason`` is a stable snake_case cause: ``no_grpcio`` (the kubernetes extra is not installed), ``no_socket``
    (no socket at the path), ``unavailable`` (nothing answers there, or the socket may not be used),
    ``timeout`` (no answer within the deadline), ``error`` (any other failure). ``hint`` says what to do.
    """

    def __init__(self, reason: str, message: str, hint: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.hint = hint


def _modules() -> tuple[Any, ModuleType, ModuleType]:
    """grpc, api_pb2 and api_pb2_grpc, imported on first use; KubeletUnavailable(no_grpcio) without them."""
    try:
        import grpc  # type: ignore[import-untyped, unused-ignore]

        from gpuwatch.hostside.podresources import api_pb2, api_pb2_grpc
    except Exception as exc:  # ImportError; protobuf's VersionError or grpc's RuntimeError on too old a runtime
        hint = _INSTALL_HINT if isinstance(exc, ImportError) else _UPGRADE_HINT
        raise KubeletUnavailable(
            "no_grpcio", f"cannot use the kubelet's PodResources API: {type(exc).__name__}: {exc}", hint
        ) from exc
    return grpc, api_pb2, api_pb2_grpc


def grpc_available() -> bool:
    """Whether grpcio and protobuf import (the optional extra gpuwatch[kubernetes]) and fit the generated code."""
    try:
        _modules()
    except KubeletUnavailable:
        return False
    return True


def strip_sharing_suffix(device_id: str) -> str:
    """``GPU-8c1f...::3`` -> ``GPU-8c1f...``: the GPU behind a time-sliced or MPS replica."""
    return _SHARING_SUFFIX.sub("", device_id)


# NVIDIA device rows an answer may hold: a node has at most a few hundred GPUs and MIG devices, each shared by
# at most a few dozen containers; 2,000,000 ids in 14 MiB (under MAX_MESSAGE_BYTES) made 500 MB of rows
MAX_ROWS = 100_000


def devices_from_response(response: Any) -> list[PodDevice]:
    """The NVIDIA devices of a ``ListPodResourcesResponse``, in the kubelet's order, without duplicates (two
    replicas of one shared GPU in one container are one row). KubeletUnavailable ("error") past MAX_ROWS rows:
    no node has them, and their memory would end the daemon."""
    seen: set[PodDevice] = set()
    out: list[PodDevice] = []
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                resource = devices.resource_name
                if not resource.startswith(RESOURCE_PREFIX):
                    continue
                for device_id in devices.device_ids:
                    row = PodDevice(pod.namespace, pod.name, container.name, resource, strip_sharing_suffix(device_id))
                    if row not in seen:
                        if len(out) >= MAX_ROWS:
                            raise KubeletUnavailable(
                                "error", f"the kubelet's answer lists more than {MAX_ROWS} NVIDIA devices",
                                "no node has that many: is something other than the kubelet on the socket?")
                        seen.add(row)
                        out.append(row)
    return out


class PodResourcesClient:
    """Calls the kubelet's ``List`` over its unix socket: one call, with a deadline, per list_devices().

    One gRPC channel stays open between calls; after a failed call it is closed and the next call opens a fresh
    one (so a restarted kubelet is found at once, not after gRPC's reconnect backoff). Thread-safe.
    """

    def __init__(self, socket_path: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._lock = threading.Lock()
        self._channel: Any = None
        self._stub: Any = None

    def list_devices(self) -> list[PodDevice]:
        """The NVIDIA devices the pods on this node hold; raises KubeletUnavailable."""
        self._check_socket()  # first: a node without a kubelet never imports grpcio (about 10 MB of RSS)
        grpc, api_pb2, api_pb2_grpc = _modules()
        channel, stub = self._connect(grpc, api_pb2_grpc)
        try:
            response = stub.List(api_pb2.ListPodResourcesRequest(), timeout=self.timeout)
        except grpc.RpcError as exc:
            self._drop(channel)
            raise self._rpc_error(grpc, exc) from exc
        except Exception as exc:
            self._drop(channel)
            raise KubeletUnavailable(
                "error", f"kubelet List on {self.socket_path} failed: {type(exc).__name__}: {exc}", _USER_HINT
            ) from exc
        return devices_from_response(response)

    def close(self) -> None:
        """Closes the channel; a later list_devices opens a new one."""
        with self._lock:
            channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            channel.close()

    # -------------------------------------------------------------------------------------------------------------

    def _check_socket(self) -> None:
        path = self.socket_path
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise KubeletUnavailable("no_socket", f"no kubelet socket at {path}", _MOUNT_HINT) from None
        except PermissionError as exc:  # a directory above it that this user may not enter
            raise KubeletUnavailable("unavailable", f"cannot look up {path}: {exc}", _USER_HINT) from exc
        except OSError as exc:
            raise KubeletUnavailable("no_socket", f"cannot look up {path}: {exc}", _MOUNT_HINT) from exc
        if not stat.S_ISSOCK(mode):
            raise KubeletUnavailable("no_socket", f"{path} is not a unix socket", _MOUNT_HINT)

    def _connect(self, grpc: Any, api_pb2_grpc: ModuleType) -> tuple[Any, Any]:
        with self._lock:
            if self._channel is None:
                self._channel = grpc.insecure_channel(
                    f"unix:{self.socket_path}",
                    options=[
                        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                        ("grpc.enable_http_proxy", 0),  # never send a local socket's traffic to an http_proxy
                        # a channel of its own connection: gRPC shares connections between channels to one address
                        # by default, and a fresh channel made after a failed call (the kubelet restarting) could
                        # take over the failed one, in its reconnect backoff (up to 2 minutes), and answer
                        # "connection refused" though the kubelet listens again
                        ("grpc.use_local_subchannel_pool", 1),
                    ],
                )
                self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
            return self._channel, self._stub

    def _drop(self, channel: Any) -> None:
        """Closes the channel of a failed call, unless another call replaced it meanwhile."""
        with self._lock:
            if self._channel is not channel:
                return
            self._channel = self._stub = None
        channel.close()

    def _rpc_error(self, grpc: Any, exc: Any) -> KubeletUnavailable:
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        details = (exc.details() if callable(getattr(exc, "details", None)) else None) or str(exc)
        where = f"kubelet List on {self.socket_path}"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return KubeletUnavailable(
                "timeout",
                f"{where}: no answer within {self.timeout:g} s",
                "the kubelet may be overloaded or hung: check it (systemctl status kubelet, its logs)",
            )
        if code == grpc.StatusCode.UNAVAILABLE:
            if "permission denied" in details.lower():
                return KubeletUnavailable("unavailable", f"{where}: {details}", _USER_HINT)
            return KubeletUnavailable(
                "unavailable",
                f"{where}: {details}",
                f"is the kubelet running? (a stale socket stays behind after it stops); also {_USER_HINT}",
            )
        name = getattr(code, "name", str(code))
        hint = "check the kubelet's logs"
        if code == grpc.StatusCode.UNIMPLEMENTED:
            hint = "the kubelet serves PodResources v1 since Kubernetes 1.20: upgrade it"
        return KubeletUnavailable("error", f"{where}: {name}: {details}", hint)
