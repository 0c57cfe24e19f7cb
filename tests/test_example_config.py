"""The shipped example configuration loads, names every option, and its rules section is valid."""

import argparse
from pathlib import Path

from gpuwatch import config
from gpuwatch.rules import all_rules
from gpuwatch.rules.settings import build_configs

EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "gpuwatch.example.yml"


def test_example_config_loads_and_mentions_every_option():
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    loaded = config.load(parser.parse_args(["--config", str(EXAMPLE)]), environ={})
    assert loaded.listen_addresses == (":19400",)
    assert loaded.poll_interval == 2.0 and loaded.poll_slow_interval == 30.0
    configs = build_configs(all_rules(), loaded.rules)
    assert configs["fan_stalled"].hold_seconds == 10
    text = EXAMPLE.read_text()
    for option in config.ALL_OPTIONS:
        leaf = option.yaml_path[-1]
        assert f"{leaf}:" in text, f"{option.key} is not in the example"
