"""Service configs: flags beat env beat defaults; bad values raise ConfigError."""

from __future__ import annotations

import pytest

from droidmesh.services.receiver.config import ReceiverConfig
from droidmesh.shared.errors import ConfigError
from droidmesh.shared.service import settings


@pytest.fixture
def ckpt(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_flags_env_defaults(ckpt):
    """A flag overrides the service env var, which overrides the generic one and the default."""
    env = {"DM_RECEIVER_MODEL_PATH": ckpt, "DM_LOOKUP_TIMEOUT_S": "2", "DM_RECEIVER_DEFAULT_GROUP": "1,3"}
    cfg = settings.load(ReceiverConfig, "receiver", ["--lookup-timeout-s", "0.25"], env)
    assert cfg.lookup_timeout_s == 0.25 and cfg.default_group == (1, 3) and cfg.model_id
    assert cfg.reuse_timeout_s == 10.0


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--lookup-timeout-s", "abc"], "cannot parse"),
        (["--lookup-timeout-s", "-1"], "must be positive"),
        (["--default-group", "3,1"], "default_group"),
        (["--dtype", "int8"], "dtype"),
        (["--model-path", "/nonexistent"], "holds no checkpoint"),
    ],
)
def test_bad_values_raise(ckpt, argv, match):
    """Each bad value raises ConfigError naming the setting."""
    with pytest.raises(ConfigError, match=match):
        settings.load(ReceiverConfig, "receiver", argv, {"DM_RECEIVER_MODEL_PATH": ckpt})


def test_missing_required_field():
    """Without a model path the config refuses to load."""
    with pytest.raises(ConfigError, match="model_path"):
        settings.load(ReceiverConfig, "receiver", [], {})
