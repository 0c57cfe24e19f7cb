"""Configuration: YAML < environment < flags, strict validation, exit 78 on bad input."""

import argparse

import pytest

from gpuwatch import cli, config
from gpuwatch.errors import ConfigError


def parse(argv):
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_work_with_no_configuration():
    c = config.load(parse([]), environ={})
    assert c.listen_addresses == (":19400",)
    assert c.telemetry_path == "/metrics"
    assert (c.poll_interval, c.poll_slow_interval) == (2.0, 30.0)
    assert c.backend == "nvml"
    assert c.staleness("fast") == 6.0 and c.staleness("slow") == 90.0


def test_flags_win_over_env_and_env_over_file(tmp_path):
    path = tmp_path / "gpuwatch.yml"
    path.write_text("poll:\n  interval: 5\n  slow_interval: 60\nweb:\n  telemetry_path: /file\nlog:\n  level: warning\n")
    env = {"GPUWATCH_POLL_INTERVAL": "3", "GPUWATCH_WEB_TELEMETRY_PATH": "/env"}
    c = config.load(parse(["--config", str(path), "--poll.interval", "1"]), environ=env)
    assert c.poll_interval == 1.0  # flag
    assert c.telemetry_path == "/env"  # env over file
    assert c.poll_slow_interval == 60.0  # file
    assert c.log_level == "warning"


def test_listen_address_is_repeatable_and_comma_separated_in_env():
    c = config.load(parse(["--web.listen-address", "127.0.0.1:1", "--web.listen-address", "[::1]:2"]), environ={})
    assert c.listen_addresses == ("127.0.0.1:1", "[::1]:2")
    c = config.load(parse([]), environ={"GPUWATCH_WEB_LISTEN_ADDRESS": "127.0.0.1:1,:2"})
    assert c.listen_addresses == ("127.0.0.1:1", ":2")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--poll.interval", "0"], "poll.interval: must be a positive number"),
        (["--poll.interval", "nan"], "poll.interval: must be a positive number"),
        (["--poll.interval", "10", "--poll.slow-interval", "5"], "must not be shorter than"),
        (["--web.listen-address", "19400"], "is not HOST:PORT"),
        (["--web.listen-address", "::1:19400"], "brackets"),
        (["--web.listen-address", ":99999"], "port must be"),
        (["--web.telemetry-path", "metrics"], "must start with '/'"),
        (["--backend", "dcgm"], "backend: must be one of nvml, simulated"),
        (["--sim.gpus", "65"], "between 1 and 64"),
    ],
)
def test_bad_values_are_refused_with_a_clear_message(argv, message):
    with pytest.raises(ConfigError, match=message):
        config.load(parse(argv), environ={})


def test_unknown_yaml_key_is_an_error_naming_the_key(tmp_path):
    path = tmp_path / "c.yml"
    path.write_text("poll:\n  intervall: 2\n")
    with pytest.raises(ConfigError, match="unknown key 'poll.intervall'"):
        config.load(parse(["--config", str(path)]), environ={})


def test_invalid_yaml_says_where(tmp_path):
    path = tmp_path / "c.yml"
    path.write_text("poll:\n  interval: [2\n")
    with pytest.raises(ConfigError, match="not valid YAML .line"):
        config.load(parse(["--config", str(path)]), environ={})


def test_cli_exits_78_on_bad_config_without_traceback(tmp_path, capsys):
    rc = cli.main(["run", "--config", str(tmp_path / "missing.yml")])
    err = capsys.readouterr().err
    assert rc == 78
    assert "config file" in err and "cannot read it: No such file" in err and "Traceback" not in err
