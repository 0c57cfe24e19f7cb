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
        (["--poll.interval", "nan"], "poll.interval: expected a number of seconds, got 'nan'"),
        # what float() and int() take and no one means: underscores, other scripts' digits, Unicode spaces
        (["--poll.interval", "1_0"], "poll.interval: expected a number of seconds, got '1_0'"),
        (["--poll.interval", "\u0662"], "poll.interval: expected a number of seconds"),
        (["--sim.gpus", "\uff14"], "sim.gpus: expected a whole number"),
        (["--rules.expected-gpus", "8\u3000"], "rules.expected-gpus: expected a whole number"),
        (["--web.max-requests", "1_0"], "web.max-requests: expected a whole number"),
        (["--web.listen-address", ":1_9400"], "port '1_9400' is not a number"),
        (["--web.listen-address", ":\u0661\u0669\u0664\u0660\u0660"], "is not a number"),
        (["--web.listen-address", ":+80"], "port '\\+80' is not a number"),
        (["--sim.fault", "load@\u0663:utilization=0.9"], "sim.fault: .* is not KIND"),
        (["--sim.gpus", "9" * 5000], "sim.gpus: expected a whole number, got '9999"),
        (["--check.password-file", "/etc/a\0b"], "check.password-file: .* is not a file name"),
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


def test_numbers_are_read_as_people_type_them_in_ascii():
    loaded = config.load(parse(["--poll.interval", " 1.5\t", "--sim.gpus", "+16", "--web.listen-address", ":9400",
                                "--poll.slow-interval", "1e1", "--rules.expected-gpus", "8"]), environ={})
    assert (loaded.poll_interval, loaded.sim_gpus, loaded.poll_slow_interval, loaded.rules_expected_gpus) == (
        1.5, 16, 10.0, 8)
    assert config.parse_listen_address("[::1]:19400") == ("::1", 19400)
    assert config.parse_duration("d", "1h30m") == 5400 and config.parse_duration("d", " 90 ") == 90
    for bad in ("\u0661\u0660s", "1_0s", "1e400", "10**3", "", True):
        with pytest.raises(ConfigError, match="d: "):
            config.parse_duration("d", bad)


@pytest.mark.parametrize("text,words", [
    ("poll: {interval: " + "9" * 5000 + "}\n", "more than 4300 digits"),
    ("poll: {interval: 0x" + "f" * 5000 + "}\n", "more than 4300 digits"),
    ("poll: {interval: " + "9" * 400 + "}\n", "a whole number of 400 digits"),
    ("rules: {overheating: {hold: " + "9" * 400 + "}}\n", "a whole number of 400 digits"),
    ("node: {rack: " + "9" * 30 + "}\n", "a whole number of 30 digits"),
    ("node: {rack: 2026-13-45}\n", "month must be in 1..12"),
    ("poll: {interval: true}\n", "poll.interval: expected a number of seconds, got True"),
    ('web: {config: {file: "/etc/a\\0b"}}\n', "web.config.file: .* is not a file name"),
])
def test_yaml_values_no_reader_can_take_are_config_errors(tmp_path, text, words):
    """A number beyond any setting (float() of a 400-digit one overflowed, str() of a 5000-digit one raised),
    a date that is no date, a NUL in a file name: each a ConfigError naming the file or the setting."""
    path = tmp_path / "gpuwatch.yml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words):
        config.load(environ={"GPUWATCH_CONFIG": str(path)})


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
