import pytest

from gpuwatch import logs


@pytest.fixture(autouse=True)
def _quiet_logs(capsys):
    """Logs go to stderr as JSON lines in tests, like under journald."""
    logs.configure("debug", "json")
    yield
