"""tetri/config.py: defaults, the TOML file, the environment, explicit overrides, and the errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tetri.config import (
    ConfigError,
    DaemonSettings,
    WorkerSettings,
    advisor_inputs,
    is_loopback,
    load_daemon_settings,
    load_worker_settings,
    start_policies,
)
from tetri.scheduling.policyset import PolicySet


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No TETRI_* variable from the outer environment may leak into these tests."""
    for key in list(os.environ):
        if key.startswith("TETRI_"):
            monkeypatch.delenv(key)


def _write(tmp_path: Path, text: str, name: str = "tetri.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --- defaults -------------------------------------------------------------------------------------


def test_daemon_defaults() -> None:
    s = load_daemon_settings()
    assert s.host == "127.0.0.1"
    assert s.port == 8000
    assert s.grpc_host == "127.0.0.1"
    assert s.grpc_port == 50051
    assert s.state_dir == Path("state")
    assert s.db_url is None
    assert s.token is None
    assert s.api_keys == []
    assert s.report_interval_s == 0.1
    assert s.unhealthy_after == 5
    assert s.load_sample_every == 10
    assert s.time_scale == 1.0
    assert not s.needs_token()


def test_worker_defaults() -> None:
    s = load_worker_settings()
    assert s.role == "prefill"
    assert s.engine == "sim"
    assert s.profile == "opt-13b-v100"
    assert s.time_scale == 1.0
    assert s.instance_id is None
    assert s.host == "127.0.0.1"
    assert s.port == 0
    assert s.daemon == "127.0.0.1:50051"
    assert s.token is None


def test_database_url_default_is_under_state_dir(tmp_path: Path) -> None:
    assert load_daemon_settings().database_url() == "sqlite:///state/tetri.db"
    s = load_daemon_settings(state_dir=tmp_path / "st")
    assert s.database_url() == f"sqlite:///{(tmp_path / 'st' / 'tetri.db').as_posix()}"
    explicit = load_daemon_settings(state_dir=tmp_path, db_url="postgresql://db/tetri")
    assert explicit.database_url() == "postgresql://db/tetri"


# --- file, environment, overrides ---------------------------------------------------------------


def test_file_values_applied(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
[daemon]
port = 9001
grpc_port = 9002
max_migrations = 7
state_dir = "/var/lib/tetri"
api_keys = ["k1", "k2"]
report_interval_s = 0.25
time_scale = 50.0

[worker]
role = "decode"
profile = "tiny"
time_scale = 50.0
daemon = "10.0.0.5:9002"
""",
    )
    d = load_daemon_settings(path)
    assert (d.port, d.grpc_port, d.max_migrations) == (9001, 9002, 7)
    assert d.state_dir == Path("/var/lib/tetri")
    assert d.api_keys == ["k1", "k2"]
    assert d.report_interval_s == 0.25
    assert d.time_scale == 50.0
    assert d.host == "127.0.0.1"  # not in the file: default
    w = load_worker_settings(path)
    assert (w.role, w.profile, w.time_scale, w.daemon) == ("decode", "tiny", 50.0, "10.0.0.5:9002")
    assert w.port == 0


def test_missing_section_means_defaults(tmp_path: Path) -> None:
    path = _write(tmp_path, '[worker]\nrole = "decode"\n')
    assert load_daemon_settings(path).port == 8000
    assert load_worker_settings(path).role == "decode"


def test_config_path_from_tetri_config_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, "[daemon]\nport = 9100\n")
    monkeypatch.setenv("TETRI_CONFIG", str(path))
    assert load_daemon_settings().port == 9100
    other = _write(tmp_path, "[daemon]\nport = 9200\n", name="other.toml")
    assert load_daemon_settings(other).port == 9200  # an explicit path beats TETRI_CONFIG


def test_env_beats_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, '[daemon]\nport = 9001\nmax_migrations = 7\n[worker]\nrole = "decode"\n')
    monkeypatch.setenv("TETRI_DAEMON_PORT", "9500")
    monkeypatch.setenv("TETRI_WORKER_ROLE", "colocated")
    d = load_daemon_settings(path)
    assert d.port == 9500
    assert d.max_migrations == 7  # other file values still apply
    assert load_worker_settings(path).role == "colocated"


def test_env_var_name_is_case_insensitive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("tetri_daemon_port", "9600")
    assert load_daemon_settings().port == 9600


def test_override_beats_env_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, "[daemon]\nport = 9001\n[worker]\nport = 7001\n")
    monkeypatch.setenv("TETRI_DAEMON_PORT", "9500")
    monkeypatch.setenv("TETRI_WORKER_PORT", "7500")
    assert load_daemon_settings(path, port=9999).port == 9999
    assert load_worker_settings(path, port=7999).port == 7999


def test_none_override_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CLI flags that were not given arrive as None and must not mask the file or the environment."""
    path = _write(tmp_path, "[daemon]\nport = 9001\ngrpc_port = 9002\n")
    monkeypatch.setenv("TETRI_DAEMON_GRPC_PORT", "9502")
    s = load_daemon_settings(path, port=None, grpc_port=None, token=None)
    assert (s.port, s.grpc_port) == (9001, 9502)


def test_other_roles_env_does_not_hide_file_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, "[daemon]\nport = 9001\n[worker]\nport = 7001\n")
    monkeypatch.setenv("TETRI_WORKER_PORT", "7500")  # the worker's variable only
    assert load_daemon_settings(path).port == 9001


# --- errors ---------------------------------------------------------------------------------------


def test_unknown_key_in_daemon_section(tmp_path: Path) -> None:
    path = _write(tmp_path, "[daemon]\nport = 9001\nbogus_knob = 3\n")
    with pytest.raises(ConfigError, match="bogus_knob") as exc:
        load_daemon_settings(path)
    assert "[daemon]" in str(exc.value)


def test_unknown_key_in_worker_section(tmp_path: Path) -> None:
    path = _write(tmp_path, '[worker]\nrole = "decode"\nflavour = "x"\n')
    with pytest.raises(ConfigError, match="flavour"):
        load_worker_settings(path)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("port = 70000", "port"),
        ("grpc_port = -1", "grpc_port"),
        ('port = "eighty"', "port"),
        ("report_interval_s = 0", "report_interval_s"),
        ("unhealthy_after = 0", "unhealthy_after"),
    ],
)
def test_bad_value_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = _write(tmp_path, f"[daemon]\n{text}\n")
    with pytest.raises(ConfigError) as exc:
        load_daemon_settings(path)
    msg = str(exc.value)
    assert f"[daemon] {field}:" in msg
    assert "\n" not in msg


def test_bad_value_from_env_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETRI_DAEMON_PORT", "70000")
    with pytest.raises(ConfigError, match="port"):
        load_daemon_settings()
    monkeypatch.delenv("TETRI_DAEMON_PORT")
    with pytest.raises(ConfigError, match="time_scale"):
        load_worker_settings(time_scale=0)
    with pytest.raises(ConfigError, match=r"\[daemon\] time_scale"):
        load_daemon_settings(time_scale=-1)


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="cannot read config") as exc:
        load_daemon_settings(missing)
    assert str(missing) in str(exc.value)


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_worker_settings(tmp_path)


def test_malformed_toml(tmp_path: Path) -> None:
    path = _write(tmp_path, "[daemon\nport = = 1\n")
    with pytest.raises(ConfigError) as exc:
        load_daemon_settings(path)
    assert str(path) in str(exc.value)


def test_section_not_a_table(tmp_path: Path) -> None:
    path = _write(tmp_path, "daemon = 3\n")
    with pytest.raises(ConfigError, match=r"\[daemon\] must be a table"):
        load_daemon_settings(path)


# --- token requirement off loopback ---------------------------------------------------------------


@pytest.mark.parametrize("field", ["host", "grpc_host"])
def test_off_loopback_needs_token(field: str) -> None:
    with pytest.raises(ConfigError, match="token"):
        load_daemon_settings(**{field: "0.0.0.0"})
    s = load_daemon_settings(token="s3cret", **{field: "0.0.0.0"})
    assert s.needs_token()
    assert s.token == "s3cret"


def test_off_loopback_token_from_file_or_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, '[daemon]\nhost = "0.0.0.0"\n')
    with pytest.raises(ConfigError, match="token"):
        load_daemon_settings(path)
    monkeypatch.setenv("TETRI_DAEMON_TOKEN", "from-env")
    assert load_daemon_settings(path).token == "from-env"


def test_empty_token_off_loopback_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TETRI_DAEMON_TOKEN", "")
    with pytest.raises(ConfigError, match="token"):
        load_daemon_settings(host="0.0.0.0")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "localhost", "::1"])
def test_loopback_hosts_need_no_token(host: str) -> None:
    assert is_loopback(host)
    assert load_daemon_settings(host=host, grpc_host=host).token is None


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "example.com"])
def test_non_loopback_hosts(host: str) -> None:
    assert not is_loopback(host)


# --- worker role --------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_worker_roles_accepted(role: str) -> None:
    assert load_worker_settings(role=role).role == role


def test_worker_bad_role(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"\[worker\] role:"):
        load_worker_settings(role="router")
    path = _write(tmp_path, '[worker]\nrole = "both"\n')
    with pytest.raises(ConfigError, match="role"):
        load_worker_settings(path)
    monkeypatch.setenv("TETRI_WORKER_ROLE", "nope")
    with pytest.raises(ConfigError, match="role"):
        load_worker_settings()


def test_worker_bad_engine() -> None:
    with pytest.raises(ConfigError, match="engine"):
        load_worker_settings(engine="tgi")
    with pytest.raises(ConfigError, match="kv_connector"):
        load_worker_settings(engine="vllm", model="/m", kv_connector="Carrier-Pigeon")
    with pytest.raises(ConfigError, match="on_missing_kv"):
        load_worker_settings(engine="vllm", model="/m", on_missing_kv="shrug")
    with pytest.raises(ConfigError, match="model: --engine vllm needs"):
        load_worker_settings(engine="vllm")
    with pytest.raises(ConfigError, match="kv_connector"):  # replaced by HostKVConnector (docs/vllm.md)
        load_worker_settings(engine="vllm", model="/m", kv_connector="ExampleConnector")
    with pytest.raises(ConfigError, match="engine_cpus"):
        load_worker_settings(engine="vllm", model="/m", engine_cpus="0;1")
    s = load_worker_settings(engine="vllm", model="/m", kv_both=True, chunk_size=256, engine_cpus="0,2-3")
    assert (s.engine, s.kv_connector, s.kv_both, s.chunk_size) == ("vllm", "HostKVConnector", True, 256)
    assert s.engine_cpus == "0,2-3"


def test_settings_classes_forbid_extra() -> None:
    """The classes themselves (not only the loader) refuse unknown fields."""
    with pytest.raises(ValueError, match="nonsense"):
        DaemonSettings(nonsense=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="nonsense"):
        WorkerSettings(nonsense=1)  # type: ignore[call-arg]


def test_starting_policies_from_the_file_and_their_errors(tmp_path: Path) -> None:
    cfg = tmp_path / "t.toml"
    cfg.write_text('[daemon]\npolicies = {colocated_schedule = "vllm-v1", chunk_size = 256}\n')
    s = load_daemon_settings(cfg)
    assert start_policies(s) == PolicySet(colocated_schedule="vllm-v1", chunk_size=256)
    assert start_policies(load_daemon_settings(None)) == PolicySet()
    for text, field in (("{colocated_schedule = 'v9'}", "colocated_schedule"), ("{nope = 1}", "nope")):
        cfg.write_text(f"[daemon]\npolicies = {text}\n")
        with pytest.raises(ConfigError, match=rf"^\[daemon\] policies\.{field}: "):
            load_daemon_settings(cfg)


def test_the_daemon_flag_sets_a_starting_policy_and_refuses_a_bad_one(capsys: pytest.CaptureFixture[str]) -> None:
    from daemon.main import _policy_args, main

    assert _policy_args(["colocated_schedule=vllm-v0", "chunk_size=128"]) == {
        "colocated_schedule": "vllm-v0",
        "chunk_size": 128,
    }
    assert main(["--port", "0", "--grpc-port", "0", "--policy", "colocated_schedule=v9"]) == 2
    assert "policies.colocated_schedule" in capsys.readouterr().err
    assert main(["--policy", "chunk_size"]) == 2
    assert "--policy 'chunk_size': expected FIELD=VALUE" in capsys.readouterr().err


def test_advise_flip_policy_needs_a_profile_and_good_slos(tmp_path: Path) -> None:
    assert advisor_inputs(load_daemon_settings(None)) is None
    with pytest.raises(ConfigError, match=r"policies.flip_policy: advise needs .*--profile"):
        load_daemon_settings(None, policies={"flip_policy": "advise"})
    s = load_daemon_settings(None, profile="tiny", slo=["ttft=2", "HPLD:tpot=0.5"], policies={"flip_policy": "advise"})
    inputs = advisor_inputs(s)
    assert inputs is not None
    profile, slo = inputs
    assert profile.name == "tiny"
    assert slo.default.ttft_s == 2.0 and slo.by_class["HPLD"].tpot_s == 0.5
    with pytest.raises(ConfigError, match=r"^\[daemon\] profile: unknown profile 'nope'"):
        load_daemon_settings(None, profile="nope")
    with pytest.raises(ConfigError, match=r"^\[daemon\] slo: .*ttft must be a number"):
        load_daemon_settings(None, profile="tiny", slo=["ttft=x"])
    with pytest.raises(ConfigError, match=r"^\[daemon\] profile: "):
        load_daemon_settings(None, profile="tiny", profiles_file=str(tmp_path / "absent.toml"))


def test_the_example_config_has_every_setting_and_its_defaults(tmp_path: Path) -> None:
    """`tetrictl config example`: every field of both models, each default as the models have it (the
    file with every valued line uncommented loads to the defaults), and as written it changes nothing."""
    import re
    import subprocess
    import sys
    import tomllib

    r = subprocess.run(
        [sys.executable, "-m", "tetrictl.app", "config", "example"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert tomllib.loads(text) == {"daemon": {}, "worker": {}, "ctl": {}}  # all commented out
    for model in (DaemonSettings, WorkerSettings):
        for key in model.model_fields:
            assert re.search(rf"^# {key} =", text, re.M), key
    live = "\n".join(re.sub(r"^# (\w+ = (?!\s*\(no default\)).*)$", r"\1", line) for line in text.splitlines())
    path = _write(tmp_path, live)
    assert load_daemon_settings(path).model_dump() == DaemonSettings().model_dump()
    assert load_worker_settings(path).model_dump() == WorkerSettings().model_dump()
    assert tomllib.loads(live)["ctl"] == {"url": "http://127.0.0.1:8000"}
    out = tmp_path / "example.toml"
    w = subprocess.run(
        [sys.executable, "-m", "tetrictl.app", "config", "example", "-o", str(out)], capture_output=True, text=True
    )
    assert w.returncode == 0 and out.read_text() == text
    again = subprocess.run(
        [sys.executable, "-m", "tetrictl.app", "config", "example", "-o", str(out)], capture_output=True, text=True
    )
    assert again.returncode == 2 and "exists" in again.stderr
