"""Text from the host that becomes a label value must be text a /metrics body can carry: UTF-8.

Python hands bytes that are not UTF-8 over as lone surrogates (``pwd``'s names, ``os.environ``'s values), and
one of them in one label made every render raise UnicodeEncodeError: every scrape of the node failed.
"""

from __future__ import annotations

import types

from gpuwatch import attribution
from gpuwatch.attribution import Attributor
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
