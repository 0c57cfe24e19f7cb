"""Text from the host that becomes a label value must be text a /metrics body can carry: UTF-8.

Python hands bytes that are not UTF-8 over as lone surrogates (``pwd``'s names, ``os.environ``'s values), and
one of them in one label made every render raise UnicodeEncodeError: every scrape of the node failed.
"""

from __future__ import annotations

import os
import types

import pytest

from gpuwatch import attribution
from gpuwatch.attribution import Attributor
from gpuwatch.errors import ConfigError
from gpuwatch.model import GpuProcess
from gpuwatch.testing import identity


def test_a_user_name_that_is_not_utf8_is_the_uid(tmp_path, monkeypatch):
    """/etc/passwd with ``b"b\\xffd"`` for uid 4242: pwd.getpwuid gives "b\\udcffd" (tried for real in a mount
    namespace); the user is the number, as for a uid without a name, and one warning says why."""
    from structlog.testing import capture_logs

    names = {4242: "b\udcffd\udcfeuser", 1000: "alice"}
    monkeypatch.setattr(attribution.pwd, "getpwuid", lambda uid: types.SimpleNamespace(pw_name=names[uid]))
    attribution.user_name.cache_clear()
    try:
        for pid, uid in ((100, 4242), (101, 1000)):
            (tmp_path / str(pid)).mkdir()
            (tmp_path / str(pid) / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_7/step_0\n")
            (tmp_path / str(pid) / "status").write_text(f"Name:\tpython\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
        with capture_logs() as logs:
            infos = Attributor(tmp_path).attribute(identity(0), (GpuProcess(100, 1), GpuProcess(101, 1)))
            assert attribution.user_name(4242) == "4242"  # kept: no second lookup, no second warning
    finally:
        attribution.user_name.cache_clear()
    assert sorted(i.user for i in infos) == ["4242", "alice"]
    assert all(i.user.encode("utf-8") for i in infos)
    assert [(e["event"], e["source"], e["uid"]) for e in logs] == [("host_input_skipped", "passwd", 4242)]


@pytest.mark.parametrize(("key", "env"), [("node.rack", "GPUWATCH_NODE_RACK"), ("node.pdu", "GPUWATCH_NODE_PDU"),
                                          ("web.telemetry-path", "GPUWATCH_WEB_TELEMETRY_PATH")])
def test_an_option_whose_text_is_not_utf8_is_a_config_error(tmp_path, key, env):
    """GPUWATCH_NODE_RACK=$'r\\xff' (os.environ: "r\\udcff") became gpuwatch_node_info's rack label and every
    scrape got 500; a telemetry path so spelt made the daemon exit with a traceback (the landing page's
    encode). Each is now a ConfigError naming the option, from the environment and from YAML's escape."""
    from gpuwatch import config

    value = "/m" + os.fsdecode(b"\xff") if key == "web.telemetry-path" else os.fsdecode(b"r\xff1")
    with pytest.raises(ConfigError, match=f"{key}: .* is not UTF-8"):
        config.load(environ={env: value})
    section, name = key.split(".", 1)
    path = tmp_path / "c.yml"
    path.write_text(f'{section}: {{{name.replace("-", "_")}: "{ascii(value)[1:-1]}"}}\n')
    with pytest.raises(ConfigError, match="is not UTF-8"):
        config.load(environ={"GPUWATCH_CONFIG": str(path)})
    assert config.load(environ={env: value.replace("\udcff", "\u00e9")})  # UTF-8 that is not ASCII: fine


@pytest.mark.parametrize(("field", "env"), [("slurm.scontrol", "GPUWATCH_COLLECTOR_SLURM_SCONTROL"),
                                            ("kubernetes.socket", "GPUWATCH_COLLECTOR_KUBERNETES_SOCKET"),
                                            ("slurm.node-name", "GPUWATCH_COLLECTOR_SLURM_NODE_NAME"),
                                            ("grace.hwmon-root", "GPUWATCH_COLLECTOR_GRACE_HWMON_ROOT")])
def test_a_path_or_name_that_is_not_utf8_is_taken_as_it_is(field, env):
    """Only the text shown as a label or page must be UTF-8: a path, or a name handed to a command, may be any
    bytes the system takes (they reach the system as those bytes again)."""
    from gpuwatch import config

    value = "/opt/" + os.fsdecode(b"sc\xff")
    assert config.load(environ={env: value}).collector_options[field] == value


def test_the_node_info_labels_of_a_loaded_config_render(inproc):
    """What the configuration lets through renders: a rack with text that is UTF-8, not ASCII."""
    import fakenvml

    d = inproc(fakenvml.FakeNode.h200(1), environ={"GPUWATCH_NODE_RACK": "r\u00e9\u2603"})
    assert d.value("gpuwatch_node_info", rack="r\u00e9\u2603", row="", room="", pdu="") == 1


def test_a_label_that_is_not_utf8_renders_as_question_marks(monkeypatch):
    """Should a source let a lone surrogate through into a label (each known one refuses or replaces it), the
    scrape still answers: those characters as "?", one warning, every other series as it was."""
    import dataclasses

    from structlog.testing import capture_logs

    from gpuwatch.clock import FakeClock
    from gpuwatch.exporter import render
    from gpuwatch.model import FEATURES, DiscoveredGpu
    from gpuwatch.store import Store
    from gpuwatch.testing import exposition, fast_sample, slow_sample

    monkeypatch.setattr(render, "_told_not_utf8", False)
    clock = FakeClock()
    store = Store(clock, "scripted")
    gpus = [DiscoveredGpu(dataclasses.replace(identity(0), name="NVIDIA H\udcff00"), {f: True for f in FEATURES}),
            DiscoveredGpu(identity(1), {f: True for f in FEATURES})]
    store.set_gpus(gpus)
    store.set_backend(True)
    for gpu in gpus:
        store.put_fast(gpu.identity.uuid, fast_sample())
        store.put_slow(gpu.identity.uuid, slow_sample())
    with capture_logs() as logs:
        text = exposition(store, clock)
        assert exposition(store, clock) == text
    info = [line for line in text.splitlines() if line.startswith("gpuwatch_gpu_info{")]
    assert len(info) == 2 and any('name="NVIDIA H?00"' in line for line in info)
    assert sum(line.startswith("gpuwatch_temperature_celsius{") and "sensor=\"gpu\"" in line for line in text.splitlines()) == 2
    assert [e["event"] for e in logs] == ["label_text_not_utf8"]
