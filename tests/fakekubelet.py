"""A fake kubelet: the PodResources API v1 (``v1.PodResourcesLister``) served by a real gRPC server on a unix socket.

In a test::

    with FakeKubelet(socket_path) as kubelet:
        kubelet.set_pods([{"namespace": "ml", "name": "train-0",
                           "containers": [{"name": "main",
                                           "devices": [{"resource_name": "nvidia.com/gpu",
                                                        "device_ids": ["GPU-1"]}]}]}])
        kubelet.fail_next(grpc.StatusCode.UNAVAILABLE)   # the next call fails so
        kubelet.hold()                                   # calls block until release() (or stop())
        kubelet.calls                                    # List calls answered or failed so far

As a process (for a daemon under test)::

    python tests/fakekubelet.py --socket PATH --pods FILE.json

FILE.json is read again on every call, so a test can change the pods while a daemon runs. It holds either a list
of pods as above or an object ``{"pods": [...], "sleep": SECONDS, "fail": "UNAVAILABLE"}``: ``sleep`` delays each
answer, ``fail`` (a gRPC status code name) fails every call. A missing or unreadable file fails the call with
INTERNAL. The process serves until SIGTERM or SIGINT, then removes the socket.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from concurrent import futures
from typing import Any

import grpc

from gpuwatch.hostside.podresources import api_pb2, api_pb2_grpc

Pods = list[dict[str, Any]]


def response_of(pods: Pods) -> api_pb2.ListPodResourcesResponse:
    """A ListPodResourcesResponse from plain dicts (namespace, name, containers: name, devices: resource_name,
    device_ids, optional numa: [node ids]; optional cpu_ids)."""
    return api_pb2.ListPodResourcesResponse(pod_resources=[pod_of(p) for p in pods])


def pod_of(pod: dict[str, Any]) -> api_pb2.PodResources:
    return api_pb2.PodResources(
        name=pod.get("name", ""),
        namespace=pod.get("namespace", ""),
        containers=[
            api_pb2.ContainerResources(
                name=c.get("name", ""),
                cpu_ids=c.get("cpu_ids", []),
                devices=[
                    api_pb2.ContainerDevices(
                        resource_name=d.get("resource_name", ""),
                        device_ids=d.get("device_ids", []),
                        topology=api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=n) for n in d.get("numa", [])]),
                    )
                    for d in c.get("devices", [])
                ],
            )
            for c in pod.get("containers", [])
        ],
    )


class _Servicer(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, kubelet: FakeKubelet) -> None:
        self.kubelet = kubelet

    def List(self, request: Any, context: grpc.ServicerContext) -> api_pb2.ListPodResourcesResponse:
        return response_of(self.kubelet._answer(context))

    def Get(self, request: Any, context: grpc.ServicerContext) -> api_pb2.GetPodResourcesResponse:
        for pod in self.kubelet._answer(context):
            if pod.get("name") == request.pod_name and pod.get("namespace") == request.pod_namespace:
                return api_pb2.GetPodResourcesResponse(pod_resources=pod_of(pod))
        context.abort(grpc.StatusCode.NOT_FOUND, f"pod {request.pod_namespace}/{request.pod_name} not found")

    def GetAllocatableResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        devices = [
            api_pb2.ContainerDevices(resource_name=d.get("resource_name", ""), device_ids=d.get("device_ids", []))
            for pod in self.kubelet._answer(context)
            for c in pod.get("containers", [])
            for d in c.get("devices", [])
        ]
        return api_pb2.AllocatableResourcesResponse(devices=devices)


class FakeKubelet:
    """The fake kubelet on ``unix:<socket_path>``; see the module docstring."""

    def __init__(self, socket_path: str, pods: Pods | None = None, pods_file: str | None = None) -> None:
        self.socket_path = socket_path
        self.pods_file = pods_file  # when set, read on every call (the process mode) instead of set_pods
        self._lock = threading.Lock()
        self._pods: Pods = list(pods or [])
        self._failures: list[tuple[grpc.StatusCode, str]] = []
        self._delay = 0.0
        self._released = threading.Event()
        self._released.set()
        self._stopping = threading.Event()
        self._calls = 0
        self.started = threading.Event()  # set when a call comes in (after counting it), e.g. one that blocks
        self._server: grpc.Server | None = None

    # --- knobs -----------------------------------------------------------------------------------------------

    def set_pods(self, pods: Pods) -> None:
        with self._lock:
            self._pods = list(pods)

    def fail_next(self, code: grpc.StatusCode, times: int = 1, details: str = "fake kubelet failure") -> None:
        """The next ``times`` calls fail with this status code."""
        with self._lock:
            self._failures.extend([(code, details)] * times)

    def delay(self, seconds: float) -> None:
        """Every answer waits this long first (0: none)."""
        with self._lock:
            self._delay = seconds

    def hold(self) -> None:
        """Calls block, answering nothing, until release() or stop() (a client's deadline passes first)."""
        self._released.clear()

    def release(self) -> None:
        self._released.set()

    @property
    def calls(self) -> int:
        with self._lock:
            return self._calls

    # --- life ------------------------------------------------------------------------------------------------

    def start(self) -> FakeKubelet:
        self._stopping.clear()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(_Servicer(self), server)
        if server.add_insecure_port(f"unix:{self.socket_path}") == 0:
            raise RuntimeError(f"fake kubelet: cannot listen on unix:{self.socket_path}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        """Stops serving (blocked calls are let go and cancelled) and removes the socket."""
        self._stopping.set()
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace=None).wait()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> FakeKubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- serving ---------------------------------------------------------------------------------------------

    def _answer(self, context: grpc.ServicerContext) -> Pods:
        """The pods to answer with, after the knobs (counting the call, failing, delaying, blocking)."""
        with self._lock:
            self._calls += 1
            failure = self._failures.pop(0) if self._failures else None
            delay = self._delay
            pods = list(self._pods)
        self.started.set()
        if self.pods_file is not None:
            spec = self._read_file(context)
            pods = spec["pods"]
            delay = float(spec.get("sleep", 0) or 0)
            if spec.get("fail"):
                failure = (grpc.StatusCode[str(spec["fail"]).upper()], "fake kubelet failure (pods file)")
        while not self._released.is_set() and not self._stopping.is_set() and context.is_active():
            self._released.wait(0.05)
        if delay > 0:
            end = time.monotonic() + delay
            while time.monotonic() < end and not self._stopping.is_set() and context.is_active():
                self._stopping.wait(min(0.05, max(0.0, end - time.monotonic())))
        if failure is not None:
            context.abort(failure[0], failure[1])
        return pods

    def _read_file(self, context: grpc.ServicerContext) -> dict[str, Any]:
        assert self.pods_file is not None
        try:
            with open(self.pods_file, encoding="utf-8") as f:
                spec = json.load(f)
        except (OSError, ValueError) as exc:
            context.abort(grpc.StatusCode.INTERNAL, f"fake kubelet: cannot read {self.pods_file}: {exc}")
        if isinstance(spec, list):
            return {"pods": spec}
        return {**spec, "pods": spec.get("pods", [])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A fake kubelet serving the PodResources API v1 on a unix socket.")
    parser.add_argument("--socket", required=True, help="the unix socket to listen on")
    parser.add_argument("--pods", required=True, help="a JSON file read on every call (see the module docstring)")
    args = parser.parse_args(argv)

    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    kubelet = FakeKubelet(args.socket, pods_file=args.pods).start()
    print(f"fakekubelet: serving on unix:{args.socket}", file=sys.stderr, flush=True)
    try:
        while not done.wait(0.5):
            pass
    finally:
        kubelet.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
