"""Flags and TANDEM_* environment variables."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from frontend_svc.config import FrontendConfig, HttpsConfig, build_arg_parser, config_from_args
from frontend_svc.server.workers import server_options

pytestmark = pytest.mark.timeout(30)


def test_environment_defaults_and_flag_overrides() -> None:
    env = {
        "TANDEM_ENGINE": "engine:7000",
        "TANDEM_PORT": "9000",
        "TANDEM_API_KEY": "k",
        "TANDEM_SERVED_MODEL_NAME": "m",
    }
    c = config_from_args([], env)
    assert (c.engine_address, c.port, c.api_key, c.served_model_name) == (
        "engine:7000",
        9000,
        "k",
        "m",
    )
    c = config_from_args(["--engine", "e2:1", "--port", "8001", "--host", "0.0.0.0"], env)
    assert (c.engine_address, c.port, c.host) == ("e2:1", 8001, "0.0.0.0")
    assert config_from_args([], {}).api_key is None


def test_module_entry_point_help() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "frontend_svc", "--help"], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0 and "--engine" in r.stdout and "--served-model-name" in r.stdout


def test_tool_call_flags() -> None:
    c = config_from_args(["--tool-call-parser", "hermes", "--enable-auto-tool-choice"], {})
    assert (c.tool_call_parser, c.enable_auto_tool_choice) == ("hermes", True)
    env = {"TANDEM_TOOL_CALL_PARSER": "pythonic", "TANDEM_ENABLE_AUTO_TOOL_CHOICE": "true"}
    c = config_from_args([], env)
    assert (c.tool_call_parser, c.enable_auto_tool_choice) == ("pythonic", True)
    c = config_from_args(["--tool-call-parser", "llama3_json"], {})  # required / named only
    assert (c.tool_call_parser, c.enable_auto_tool_choice) == ("llama3_json", False)
    assert config_from_args([], {}).tool_call_parser is None


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--enable-auto-tool-choice"], {}, "--enable-auto-tool-choice needs --tool-call-parser"),
        (["--tool-call-parser", "nope"], {}, "invalid choice: 'nope'"),
        ([], {"TANDEM_TOOL_CALL_PARSER": "nope"}, "is not one of hermes"),
        ([], {"TANDEM_ENABLE_AUTO_TOOL_CHOICE": "maybe"}, "expected true or false"),
    ],
)
def test_tool_call_flags_are_checked_at_start(
    argv: list[str], env: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        config_from_args(argv, env)
    assert message in capsys.readouterr().err


def test_response_flags() -> None:
    c = config_from_args([], {})
    assert (c.return_tokens_as_token_ids, c.enable_force_include_usage) == (False, False)
    c = config_from_args(["--return-tokens-as-token-ids", "--enable-force-include-usage"], {})
    assert (c.return_tokens_as_token_ids, c.enable_force_include_usage) == (True, True)
    env = {
        "TANDEM_RETURN_TOKENS_AS_TOKEN_IDS": "true",
        "TANDEM_ENABLE_FORCE_INCLUDE_USAGE": "1",
    }
    c = config_from_args([], env)
    assert (c.return_tokens_as_token_ids, c.enable_force_include_usage) == (True, True)


@pytest.mark.parametrize(
    ("env", "value", "field", "expected"),
    [
        ("ENGINE", "e:1", "engine_address", "e:1"),
        ("HOST", "0.0.0.0", "host", "0.0.0.0"),
        ("PORT", "9001", "port", 9001),
        ("API_KEY", "k", "api_key", "k"),
        ("SERVED_MODEL_NAME", "m", "served_model_name", "m"),
        ("RECONNECT_MAX_S", "0.25", "backoff.max_s", 0.25),
        ("RETRY_AFTER_S", "3", "retry_after_s", 3),
        ("ENGINE_RESOLVE_INTERVAL", "2.5", "routing.resolve_interval_s", 2.5),
        ("PREFIX_AFFINITY_MIN_TOKENS", "0", "routing.affinity_min_tokens", 0),
        ("PREFIX_AFFINITY_MAX_IMBALANCE", "3", "routing.affinity_max_imbalance", 3),
        ("TLS_SERVER_NAME", "engine.local", "tls.server_name", "engine.local"),
        ("MAX_BODY_BYTES", "1000", "limits.max_body_bytes", 1000),
        ("MAX_HEADER_BYTES", "2000", "limits.max_header_bytes", 2000),
        ("TOKENIZER_THREADS", "2", "limits.tokenizer_threads", 2),
        ("WORKERS", "2", "workers", 2),
        ("TOOL_CALL_PARSER", "hermes", "tool_call_parser", "hermes"),
        ("ENABLE_AUTO_TOOL_CHOICE", "yes", "enable_auto_tool_choice", True),
        ("RETURN_TOKENS_AS_TOKEN_IDS", "on", "return_tokens_as_token_ids", True),
        ("ENABLE_FORCE_INCLUDE_USAGE", "true", "enable_force_include_usage", True),
        ("LOG_LEVEL", "debug", "log_level", "debug"),
        ("UVICORN_LOG_LEVEL", "warning", "uvicorn_log_level", "warning"),
        ("SSL_CERTFILE", "c.pem", "https.certfile", "c.pem"),
        ("SSL_KEYFILE", "k.pem", "https.keyfile", "k.pem"),
        ("SSL_CA_CERTS", "ca.pem", "https.ca_certs", "ca.pem"),
        ("SSL_CERT_REQS", "2", "https.cert_reqs", 2),
    ],
)
def test_every_flag_reads_its_environment_variable(
    env: str, value: str, field: str, expected: object
) -> None:
    environ = {f"TANDEM_{env}": value}
    if env == "ENABLE_AUTO_TOOL_CHOICE":
        environ["TANDEM_TOOL_CALL_PARSER"] = "hermes"
    if env.startswith("SSL_") and env != "SSL_CERTFILE":  # each needs a certificate
        environ["TANDEM_SSL_CERTFILE"] = "c.pem"
        environ["TANDEM_SSL_CA_CERTS"] = environ.get("TANDEM_SSL_CA_CERTS", "ca.pem")
    config: object = config_from_args([], environ)
    for part in field.split("."):
        config = getattr(config, part)
    assert config == expected
    assert f"TANDEM_{env}" in build_arg_parser({}).format_help()  # --help says where


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TANDEM_PORT": "http"}, "argument --port: invalid int value: 'http'"),
        ({"TANDEM_RECONNECT_MAX_S": "soon"}, "argument --reconnect-max-s: invalid float value"),
        ({"TANDEM_RETURN_TOKENS_AS_TOKEN_IDS": "2"}, "expected true or false"),
    ],
)
def test_a_bad_environment_value_is_a_usage_error(
    env: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        config_from_args([], env)
    assert message in capsys.readouterr().err


# ---- vLLM's spellings, and help on every flag -------------------------------------------------


@pytest.mark.parametrize(
    ("vllm", "ours"),
    [
        (["--api-server-count", "3"], ["--workers", "3"]),
        (["-asc", "3"], ["--workers", "3"]),
        (["--uvicorn-log-level", "warning"], []),
        (
            ["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--ssl-ca-certs", "ca.pem"],
            [],
        ),
    ],
)
def test_vllm_spellings_parse_to_the_same_config(vllm: list[str], ours: list[str]) -> None:
    c = config_from_args(vllm, {})
    if ours:
        assert c == config_from_args(ours, {})
    assert c == FrontendConfig(
        workers=c.workers,
        uvicorn_log_level=c.uvicorn_log_level,
        https=c.https,
    )


def test_gateway_flags_reach_uvicorn() -> None:
    c = config_from_args(
        [
            "--api-server-count",
            "2",
            "--uvicorn-log-level",
            "error",
            "--ssl-certfile",
            "c.pem",
            "--ssl-keyfile",
            "k.pem",
            "--ssl-ca-certs",
            "ca.pem",
            "--ssl-cert-reqs",
            "2",
        ],
        {},
    )
    assert (c.workers, c.https) == (2, HttpsConfig("k.pem", "c.pem", "ca.pem", 2))
    options = server_options(c)
    assert options["log_level"] == "error"
    assert (options["ssl_certfile"], options["ssl_keyfile"], options["ssl_ca_certs"]) == (
        "c.pem",
        "k.pem",
        "ca.pem",
    )
    assert options["ssl_cert_reqs"] == 2
    plain = server_options(config_from_args(["--log-level", "DEBUG"], {}))
    assert plain["log_level"] == "debug"  # uvicorn follows --log-level by default
    assert not any(k.startswith("ssl_") for k in plain)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ssl-keyfile", "k.pem"], "need --ssl-certfile"),
        (["--ssl-certfile", "c.pem", "--ssl-cert-reqs", "2"], "needs --ssl-ca-certs"),
        (["--uvicorn-log-level", "loud"], "invalid choice: 'loud'"),
    ],
)
def test_bad_https_and_log_flags_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        config_from_args(argv, {})
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_every_flag_has_help() -> None:
    """Each option says what it does, not only which variable sets it."""
    parser = build_arg_parser({})
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[0]
        assert action.help and action.help != argparse.SUPPRESS, flag
        assert action.help.split(" (env TANDEM_")[0].strip(), f"{flag} has no help of its own"
