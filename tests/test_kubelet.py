"""The kubelet PodResources client (gpuwatch.hostside.kubelet) against a fake kubelet on a real unix socket."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest
from daemon import stop_process, wait_for
from fakekubelet import FakeKubelet

from gpuwatch.hostside import kubelet
from gpuwatch.hostside.kubelet import KubeletUnavailable, PodDevice, PodResourcesClient

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py")
PODRESOURCES = ROOT / "gpuwatch" / "hostside" / "podresources"

PODS = [
    {
        "namespace": "ml",
        "name": "train-0",
        "containers": [
            {"name": "main", "devices": [
                {"resource_name": "nvidia.com/gpu", "device_ids": ["GPU-aaaa", "GPU-bbbb"], "numa": [0]},
                {"resource_name": "example.com/fpga", "device_ids": ["fpga-0"]},
            ]},
            {"name": "sidecar", "devices": []},
        ],
    },
    {
        "namespace": "infer",
        "name": "llm-7d9f",
        "containers": [
            {"name": "server", "devices": [
                {"resource_name": "nvidia.com/mig-1g.10gb", "device_ids": ["MIG-1111"]},
                {"resource_name": "nvidia.com/mig-3g.40gb", "device_ids": ["MIG-GPU-cccc/1/0"]},
            ]},
        ],
    },
    {
        "namespace": "dev",
        "name": "notebook",
        "containers": [
            {"name": "jupyter", "devices": [
                # time-slicing: replicas of one GPU; two of them in one container are one GPU
                {"resource_name": "nvidia.com/gpu.shared", "device_ids": ["GPU-dddd::3", "GPU-dddd::7"]},
                {"resource_name": "nvidia.com/gpu", "device_ids": ["GPU-eeee::12"]},
                {"resource_name": "nvidiaXcom/gpu", "device_ids": ["GPU-ffff"]},
            ]},
        ],
    },
    {"namespace": "kube-system", "name": "coredns", "containers": [{"name": "coredns"}]},
]

EXPECTED = [
    PodDevice("ml", "train-0", "main", "nvidia.com/gpu", "GPU-aaaa"),
    PodDevice("ml", "train-0", "main", "nvidia.com/gpu", "GPU-bbbb"),
    PodDevice("infer", "llm-7d9f", "server", "nvidia.com/mig-1g.10gb", "MIG-1111"),
    PodDevice("infer", "llm-7d9f", "server", "nvidia.com/mig-3g.40gb", "MIG-GPU-cccc/1/0"),
    PodDevice("dev", "notebook", "jupyter", "nvidia.com/gpu.shared", "GPU-dddd"),
    PodDevice("dev", "notebook", "jupyter", "nvidia.com/gpu", "GPU-eeee"),
]


@pytest.fixture()
def sock_dir():
    """A short directory for sockets: a unix socket path has at most ~107 bytes, pytest's tmp_path can be longer."""
    path = tempfile.mkdtemp(prefix="gwk", dir="/tmp")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture()
def sock(sock_dir):
    return str(sock_dir / "kubelet.sock")


@pytest.fixture()
def fake(sock):
    with FakeKubelet(sock, PODS) as fake:
        yield fake


@pytest.fixture()
def client(sock):
    client = PodResourcesClient(sock, timeout=5.0)
    yield client
    client.close()


def reason_of(client: PodResourcesClient) -> KubeletUnavailable:
    with pytest.raises(KubeletUnavailable) as info:
        client.list_devices()
    err = info.value
    assert err.message and err.hint and str(err) == err.message
    return err


def test_lists_the_nvidia_devices_of_each_container(fake, client):
    assert client.list_devices() == EXPECTED
    assert fake.calls == 1


def test_one_channel_is_kept_between_calls(fake, client):
    client.list_devices()
    channel = client._channel
    fake.set_pods(PODS[:1])
    assert client.list_devices() == EXPECTED[:2]
    assert client._channel is channel
    assert fake.calls == 2


def test_no_pods_no_devices(sock, client):
    with FakeKubelet(sock, []):
        assert client.list_devices() == []


def test_sharing_suffix_only_a_trailing_number():
    assert kubelet.strip_sharing_suffix("GPU-1::0") == "GPU-1"
    assert kubelet.strip_sharing_suffix("GPU-1::15") == "GPU-1"
    assert kubelet.strip_sharing_suffix("GPU-1") == "GPU-1"
    assert kubelet.strip_sharing_suffix("GPU-1::x") == "GPU-1::x"
    # other scripts' digits and a trailing newline are no replica number: the id stays whole (and matches no GPU)
    for odd in ("GPU-1::\u0663", "GPU-1::\uff13", "GPU-1::3\n"):
        assert kubelet.strip_sharing_suffix(odd) == odd
    assert kubelet.strip_sharing_suffix("0") == "0"  # DEVICE_ID_STRATEGY=index


def test_missing_socket_is_no_socket_without_connecting(sock, client):
    err = reason_of(client)
    assert err.reason == "no_socket"
    assert sock in err.message and "pod-resources" in err.hint and "read-only" in err.hint
    assert client._channel is None


def test_a_file_that_is_not_a_socket_is_no_socket(sock, client):
    Path(sock).write_text("")
    assert reason_of(client).reason == "no_socket"


def test_stale_socket_is_unavailable(sock, client):
    # what a stopped kubelet leaves behind: the socket file, with nobody listening
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sock)
    s.close()
    err = reason_of(client)
    assert err.reason == "unavailable"
    assert "kubelet running" in err.hint and "user" in err.hint
    # the kubelet comes back on the same path: found at once (a fresh channel, no reconnect backoff)
    with FakeKubelet(sock, PODS):
        assert client.list_devices() == EXPECTED


def test_a_kubelet_back_is_found_whatever_connection_failed_before(sock, client):
    """gRPC shares a connection between channels to one address: a fresh channel made after a failed call could
    take over the failed connection, in its reconnect backoff (up to 2 minutes), and answer "connection refused"
    while the kubelet listens again (the previous test failed so now and then on a loaded machine: the closed
    channel's connection was still there). Here another channel to the socket holds a failed connection for
    certain; the client's next read still finds the kubelet at once."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sock)
    s.close()
    # the client's own options (a connection is shared between channels of equal arguments)
    other = grpc.insecure_channel(f"unix:{sock}", options=[("grpc.max_receive_message_length", kubelet.MAX_MESSAGE_BYTES),
                                                           ("grpc.enable_http_proxy", 0)])
    try:
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(other).result(timeout=0.5)  # tries and fails: the connection is in backoff
        assert reason_of(client).reason == "unavailable"
        with FakeKubelet(sock, PODS):
            assert client.list_devices() == EXPECTED
    finally:
        other.close()


def test_unavailable_then_recovers(fake, client):
    assert client.list_devices() == EXPECTED
    fake.fail_next(grpc.StatusCode.UNAVAILABLE, details="kubelet restarting")
    err = reason_of(client)
    assert err.reason == "unavailable" and "kubelet restarting" in err.message
    assert client._channel is None  # dropped after the failure
    assert client.list_devices() == EXPECTED
    assert fake.calls == 3


def test_other_status_codes_are_error(fake, client):
    fake.fail_next(grpc.StatusCode.UNIMPLEMENTED)
    err = reason_of(client)
    assert err.reason == "error" and "UNIMPLEMENTED" in err.message and "1.20" in err.hint
    fake.fail_next(grpc.StatusCode.INTERNAL, details="boom")
    err = reason_of(client)
    assert err.reason == "error" and "INTERNAL" in err.message and "boom" in err.message
    assert client.list_devices() == EXPECTED


def test_blocked_kubelet_is_timeout(fake, sock):
    client = PodResourcesClient(sock, timeout=0.5)
    try:
        fake.hold()
        err = reason_of(client)
        assert err.reason == "timeout" and "0.5 s" in err.message
        fake.release()
        client.timeout = 5.0  # the same client answers again (a roomy deadline: a loaded CI machine)
        assert client.list_devices() == EXPECTED
    finally:
        client.close()


def test_server_stops_and_comes_back(sock, client):
    with FakeKubelet(sock, PODS):
        assert client.list_devices() == EXPECTED
    # stopped: the fake removes its socket, as the kubelet does on a clean stop
    assert reason_of(client).reason == "no_socket"
    with FakeKubelet(sock, PODS[1:2]) as again:
        assert client.list_devices() == EXPECTED[2:4]
        assert again.calls == 1


def test_server_gone_under_an_open_channel(sock, client):
    fake = FakeKubelet(sock, PODS).start()
    try:
        assert client.list_devices() == EXPECTED
    finally:
        fake.stop()
    # a stale socket file where the channel's server was
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(sock)
    s.close()
    assert reason_of(client).reason == "unavailable"
    with FakeKubelet(sock, PODS):
        assert client.list_devices() == EXPECTED


def test_close_then_list_again(fake, client):
    assert client.list_devices() == EXPECTED
    client.close()
    client.close()
    assert client._channel is None
    assert client.list_devices() == EXPECTED


def test_fake_kubelet_as_a_process(sock_dir, sock):
    pods_file = sock_dir / "pods.json"
    pods_file.write_text(json.dumps(PODS[:1]))
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fakekubelet.py"), "--socket", sock,
                             "--pods", str(pods_file)], cwd=ROOT)
    client = PodResourcesClient(sock, timeout=5.0)
    try:
        wait_for(lambda: os.path.exists(sock) or proc.poll() is not None, what="the fake kubelet's socket")
        assert proc.poll() is None
        assert client.list_devices() == EXPECTED[:2]
        pods_file.write_text(json.dumps({"pods": PODS}))  # read again on the next call
        assert client.list_devices() == EXPECTED
        pods_file.write_text(json.dumps({"pods": PODS, "fail": "UNAVAILABLE"}))
        assert reason_of(client).reason == "unavailable"
        pods_file.write_text(json.dumps({"pods": PODS, "sleep": 30}))
        client.timeout = 0.5
        assert reason_of(client).reason == "timeout"
        client.timeout = 5.0
        pods_file.write_text(json.dumps({"pods": PODS[1:2]}))
        assert client.list_devices() == EXPECTED[2:4]
    finally:
        client.close()
        assert stop_process(proc) == 0
    assert not os.path.exists(sock)


# --- the generated code ------------------------------------------------------------------------------------------


def _generated_version() -> str:
    text = (PODRESOURCES / "api_pb2_grpc.py").read_text()
    return text.split("GRPC_GENERATED_VERSION = '", 1)[1].split("'", 1)[0]


def test_generated_code_matches_the_proto(tmp_path):
    """scripts/gen-podresources into a temp dir gives the tree's files, byte for byte (with the same grpcio-tools:
    its version is in the generated code)."""
    from importlib.metadata import version

    tools = version("grpcio-tools")
    if tools != _generated_version():
        pytest.skip(f"grpcio-tools {tools} installed, the code was generated with {_generated_version()}: "
                    "test_generated_descriptor_matches_the_proto still checks it")
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run([str(ROOT / "scripts" / "gen-podresources"), str(tmp_path)], check=True, env=env, cwd="/")
    out = tmp_path / "gpuwatch" / "hostside" / "podresources"
    assert sorted(p.name for p in out.iterdir()) == sorted(GENERATED)
    for name in GENERATED:
        assert (out / name).read_bytes() == (PODRESOURCES / name).read_bytes(), \
            f"{name} is out of date: run scripts/gen-podresources"


def test_generated_descriptor_matches_the_proto(tmp_path):
    """Whatever grpcio-tools is installed: the descriptor compiled into api_pb2.py is the .proto's."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    from gpuwatch.hostside.podresources import api_pb2

    out = tmp_path / "api.desc"
    assert protoc.main(["protoc", f"-I{ROOT}", f"--descriptor_set_out={out}",
                        str(PODRESOURCES / "api.proto")]) == 0
    (compiled,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    for message in compiled.message_type:  # protoc fills in json_name here; the generated code leaves it out
        for field in message.field:
            field.ClearField("json_name")
    embedded = descriptor_pb2.FileDescriptorProto.FromString(api_pb2.DESCRIPTOR.serialized_pb)
    assert embedded == compiled
    assert embedded.package == "v1"
    assert [m.name for m in embedded.service[0].method] == ["List", "GetAllocatableResources", "Get"]


def test_generated_grpc_code_imports_api_pb2_from_the_package():
    text = (PODRESOURCES / "api_pb2_grpc.py").read_text()
    assert "from gpuwatch.hostside.podresources import api_pb2 as" in text
    for name in GENERATED:
        head = (PODRESOURCES / name).read_text().splitlines()[:3]
        assert "# ruff: noqa" in head and "# mypy: ignore-errors" in head


# --- without grpcio ----------------------------------------------------------------------------------------------

NO_GRPC = r"""
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "grpc" or name.startswith(("grpc.", "google.protobuf")):
            raise ImportError(f"blocked: {name}")
        return None

sys.meta_path.insert(0, Block())
for name in list(sys.modules):
    if name == "grpc" or name.startswith(("grpc.", "google.protobuf")):
        del sys.modules[name]

import gpuwatch.hostside.kubelet as kubelet

assert "gpuwatch.hostside.podresources.api_pb2" not in sys.modules
assert kubelet.grpc_available() is False
client = kubelet.PodResourcesClient(sys.argv[1])
try:
    client.list_devices()
except kubelet.KubeletUnavailable as err:
    assert "gpuwatch[kubernetes]" in err.hint, err.hint
    print(err.reason)
client.close()
"""


def test_imports_without_grpcio(sock, fake):  # a kubelet is there: the socket is looked at before grpcio
    done = subprocess.run([sys.executable, "-c", NO_GRPC, sock], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no_grpcio"


def test_imports_with_grpc_set_to_none_in_sys_modules(sock, fake):  # a kubelet is there: the socket is looked at before grpcio
    code = ("import sys; sys.modules['grpc'] = None\n"
            "from gpuwatch.hostside import kubelet\n"
            "assert not kubelet.grpc_available()\n"
            "try:\n    kubelet.PodResourcesClient(sys.argv[1]).list_devices()\n"
            "except kubelet.KubeletUnavailable as err:\n    print(err.reason)\n")
    done = subprocess.run([sys.executable, "-c", code, sock], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no_grpcio"


def test_grpc_available_here():
    assert kubelet.grpc_available() is True


def test_too_old_protobuf_runtime_is_no_grpcio(sock, fake):  # a kubelet is there: the socket is looked at before grpcio
    """protobuf older than the generated code demands (its ValidateProtobufRuntimeVersion) is reason no_grpcio."""
    code = ("import sys\nfrom google.protobuf import runtime_version\nruntime_version.MAJOR = 5\n"
            "from gpuwatch.hostside import kubelet\n"
            "assert not kubelet.grpc_available()\n"
            "try:\n    kubelet.PodResourcesClient(sys.argv[1]).list_devices()\n"
            "except kubelet.KubeletUnavailable as err:\n    print(err.reason, err.message)\n")
    done = subprocess.run([sys.executable, "-c", code, sock], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("no_grpcio ") and "VersionError: " in done.stdout


def test_an_answer_with_more_device_rows_than_any_node_has_is_an_error(fake, client, monkeypatch):
    """2,000,000 ids in 14 MiB (under the message limit) made 500 MB of rows: past MAX_ROWS the answer is an
    error ("error", as any other unusable answer), and the next sane answer is read."""
    monkeypatch.setattr(kubelet, "MAX_ROWS", 5)
    ids = [f"GPU-{i:04d}" for i in range(6)]
    fake.set_pods([{"namespace": "x", "name": "many", "containers": [
        {"name": "c", "devices": [{"resource_name": "nvidia.com/gpu", "device_ids": ids}]}]}])
    err = reason_of(client)
    assert err.reason == "error" and "more than 5 NVIDIA devices" in err.message
    fake.set_pods([{"namespace": "x", "name": "few", "containers": [
        {"name": "c", "devices": [{"resource_name": "nvidia.com/gpu", "device_ids": ids[:5] * 3}]}]}])
    assert [d.device_id for d in client.list_devices()] == ids[:5]  # duplicates are one row each


def test_unknown_device_ids_are_remembered_as_logged_not_whole(fake, sock):
    """A 10 MB unknown device id that changes each read was kept whole in the logged set (up to 64 of them)."""
    from structlog.testing import capture_logs

    from gpuwatch.hostside import KubeletPods

    pods = KubeletPods(sock, 5.0, [])
    with capture_logs() as logs:
        for n in range(3):
            fake.set_pods([{"namespace": "x", "name": "p", "containers": [
                {"name": "c", "devices": [{"resource_name": "nvidia.com/gpu", "device_ids": [f"GPU-{n}" + "z" * 100_000]}]}]}])
            assert pods.read([]) == ((), False)  # incomplete: a GPU without a pod is unknown, not free
    pods.close()
    shown = [e["device_id"] for e in logs if e["event"] == "kubelet_device_unknown"]
    assert len(shown) == 3 and all(len(d) == 200 for d in shown)
    assert all(len(d) <= 200 for d in pods._unknown_logged)
