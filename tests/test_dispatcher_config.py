"""Dispatcher configuration: tokens from a file and the environment, scopes, limits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kombu_envelope.dispatcher.config import (
    TOKENS_ENV,
    TOKENS_FILE_ENV,
    DispatcherConfig,
    Scope,
    load_tokens,
)

SECRET = "s" * 20


def test_tokens_from_file_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps([{"name": "billing", "scope": "write", "token": SECRET}]))
    tokens = load_tokens(environ={TOKENS_FILE_ENV: str(path), TOKENS_ENV: f"read:{'r' * 20}"})
    assert [(t.name, t.scope) for t in tokens] == [("billing", Scope.WRITE),
                                                  ("env-1", Scope.READ)]
    assert SECRET not in repr(tokens)
    config = DispatcherConfig(host="0.0.0.0", tokens=tuple(tokens))
    assert config.token(SECRET) is tokens[0] and config.token("x" * 20) is None


@pytest.mark.parametrize(("environ", "message"), [
    ({TOKENS_ENV: "admin:" + SECRET}, "scope must be one of read, write, operator"),
    ({TOKENS_ENV: "read:short"}, "at least 16 printable characters"),
    ({TOKENS_ENV: SECRET}, "expected <scope>:<token>"),
    ({TOKENS_ENV: f"read:{SECRET},write:{SECRET}"}, "must be unique"),
])
def test_bad_tokens_are_refused_naming_the_problem(environ: dict[str, str],
                                                   message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_tokens(environ=environ)


def test_bad_token_file(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    path.write_text('{"token": "x"}')
    with pytest.raises(ValueError, match="JSON array"):
        load_tokens(path, environ={})
    path.write_text('[{"scope": "read"}]')
    with pytest.raises(ValueError, match="item 1 needs string fields"):
        load_tokens(path, environ={})


def test_scopes_include_the_ones_before() -> None:
    assert Scope.OPERATOR.allows(Scope.READ) and Scope.WRITE.allows(Scope.WRITE)
    assert not Scope.READ.allows(Scope.WRITE) and not Scope.WRITE.allows(Scope.OPERATOR)


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="batch_max"):
        DispatcherConfig(batch_max=0)
    with pytest.raises(ValueError, match="rate_per_s"):
        DispatcherConfig(rate_per_s=0)


@pytest.mark.parametrize(("args", "message"), [
    (["--url", "envelope-sentinel://127.0.0.1:1"], "transport option 'master_name'"),
    (["--url", "envelope://127.0.0.1:1", "-o", "lease=1"], "did you mean 'lease_ms'"),
    (["--url", "envelope://127.0.0.1:1", "--host", "0.0.0.0"], "loopback address only"),
])
def test_command_line_refuses_bad_options_naming_them(args: list[str], message: str) -> None:
    ran = subprocess.run([sys.executable, "-m", "kombu_envelope.dispatcher", *args],
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 2 and message in ran.stderr, ran.stderr
