"""Service settings from a TOML file: precedence flags > env > file > defaults, strict keys and types,
and every bad setting is one line and exit 2 from a real service process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from droidmesh.services.cache_broker.config import BrokerConfig
from droidmesh.shared.errors import ConfigError
from droidmesh.shared.service import settings


def _toml(tmp_path, text: str) -> str:
    path = tmp_path / "broker.toml"
    path.write_text(text)
    return str(path)


def test_file_sets_fields(tmp_path):
    """Keys of the file become the fields; the rest keep their defaults."""
    path = _toml(tmp_path, 'nats_url = "nats://a:4222"\nmetrics_port = 9100\nlog_level = "debug"\n')
    cfg = settings.load(BrokerConfig, "cache_broker", ["--config", path], {})
    assert (cfg.nats_url, cfg.metrics_port, cfg.log_level) == ("nats://a:4222", 9100, "debug")
    assert cfg.nats_user == BrokerConfig().nats_user


def test_precedence_flags_env_file_defaults(tmp_path):
    """A flag beats the env, the env beats the file, the file beats the default."""
    path = _toml(tmp_path, 'nats_url = "nats://file:1"\nmetrics_port = 1\nlog_level = "error"\n')
    env = {"DM_CACHE_BROKER_METRICS_PORT": "2", "DM_LOG_LEVEL": "warning"}
    cfg = settings.load(BrokerConfig, "cache_broker", ["--config", path, "--log-level", "debug"], env)
    assert (cfg.log_level, cfg.metrics_port, cfg.nats_url) == ("debug", 2, "nats://file:1")


@pytest.mark.parametrize("var", ["DM_CONFIG", "DM_CACHE_BROKER_CONFIG"])
def test_file_named_by_env(tmp_path, var):
    """DM_CONFIG (or the service's own DM_<SERVICE>_CONFIG) names the file when --config is absent."""
    path = _toml(tmp_path, "metrics_port = 7\n")
    assert settings.load(BrokerConfig, "cache_broker", [], {var: path}).metrics_port == 7


def test_tuple_field_from_array(tmp_path):
    """A tuple field is a TOML array of its element type."""
    from droidmesh.services.receiver.config import ReceiverConfig

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    path = _toml(tmp_path, f'model_path = "{tmp_path / "ckpt"}"\ndefault_group = [1, 3]\n')
    assert settings.load(ReceiverConfig, "receiver", ["--config", path], {}).default_group == (1, 3)


@pytest.mark.parametrize(
    "text,match",
    [
        ("nats_ulr = 'x'\n", "unknown key.*nats_ulr"),
        ("metrics_port = '9100'\n", "metrics_port: expected integer, got string"),
        ("metrics_port = 1.5\n", "metrics_port: expected integer, got float"),
        ("metrics_port = true\n", "metrics_port: expected integer, got boolean"),
        ("log_level = 3\n", "log_level: expected string, got integer"),
        ("log_level = 'loud'\n", "log_level"),
        ("metrics_port = \n", "not valid TOML"),
    ],
)
def test_bad_files_are_config_errors(tmp_path, text, match):
    """Unknown keys, wrong types, bad values and malformed TOML raise ConfigError naming the problem."""
    with pytest.raises(ConfigError, match=match):
        settings.load(BrokerConfig, "cache_broker", ["--config", _toml(tmp_path, text)], {})


def test_missing_file_is_a_config_error(tmp_path):
    """A --config that names no file is a ConfigError, not an OSError traceback."""
    with pytest.raises(ConfigError, match="config file"):
        settings.load(BrokerConfig, "cache_broker", ["--config", str(tmp_path / "nope.toml")], {})


def test_bad_flag_is_a_config_error():
    """An unknown flag raises ConfigError (one line) instead of argparse's usage text."""
    with pytest.raises(ConfigError, match="unrecognized arguments: --bogus"):
        settings.load(BrokerConfig, "cache_broker", ["--bogus"], {})


def test_creds_file_goes_to_nats(tmp_path):
    """nats_creds reaches nats.connect as user_credentials; a missing one is refused."""
    creds = tmp_path / "user.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n")
    assert settings.BusSettings(nats_creds=str(creds)).nats_options()["user_credentials"] == str(creds)
    with pytest.raises(ConfigError, match="nats_creds"):
        settings.BusSettings(nats_creds=str(tmp_path / "absent.creds"))


@pytest.mark.parametrize(
    "args,env",
    [
        (["--bogus"], {}),
        (["--metrics-port", "abc"], {}),
        ([], {"DM_CACHE_BROKER_LOG_LEVEL": "loud"}),
        (["--config", "/nonexistent/broker.toml"], {}),
    ],
)
def test_service_reports_bad_settings_in_one_line(args, env):
    """A real service process given a bad flag, env value or file exits 2 with one stderr line."""
    proc = subprocess.run([sys.executable, "-m", "droidmesh.services.cache_broker", *args], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", **env}, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("cache_broker: ") and "Traceback" not in proc.stderr
