"""Environment variables (``_support/environment.py``): each value is parsed once
per change, and a bad one is never remembered, so every call fails on it."""

import pytest

from jax_threadmap._support import environment as env

NAME = "JAX_THREADMAP_TEST_ONLY_VARIABLE"


def test_a_changed_value_is_read_at_the_next_call(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert env.env_positive_int(NAME, "a test") is None
    assert env.env_flag(NAME, "a test") is False
    for value in ("3", "7", " 3 "):
        monkeypatch.setenv(NAME, value)
        assert env.env_positive_int(NAME, "a test") == int(value)
    monkeypatch.setenv(NAME, "on")
    assert env.env_flag(NAME, "a test") is True
    monkeypatch.setenv(NAME, "off")
    assert env.env_flag(NAME, "a test") is False
    assert env.env_flag(NAME, "a test", default=True) is False
    for unset in ("", "  "):  # empty counts as unset
        monkeypatch.setenv(NAME, unset)
        assert env.env_flag(NAME, "a test", default=True) is True
        assert env.env_flag(NAME, "a test") is False


def test_a_bad_value_fails_every_call_until_it_changes(monkeypatch):
    for bad, read, match in (
        ("lots", lambda: env.env_positive_int(NAME, "a test"), "positive integer"),
        ("99", lambda: env.env_positive_int(NAME, "a test", 10), "at most 10"),
        ("maybe", lambda: env.env_flag(NAME, "a test"), "must be one of"),
    ):
        monkeypatch.setenv(NAME, bad)
        for _ in range(2):  # not remembered as an answer
            with pytest.raises(ValueError, match=f"{match}.*{NAME}={bad!r}"):
                read()
        monkeypatch.setenv(NAME, "1")
        assert read() in (1, True)


def test_the_dispatch_mode_follows_the_variable(monkeypatch):
    monkeypatch.delenv(env.ENV_ASYNC_DISPATCH, raising=False)
    assert env.async_dispatch_mode() == "async"
    cases = (("0", "off"), ("off", "off"), ("1", "async"), (" Deferred", "async"))
    for value, mode in cases:
        monkeypatch.setenv(env.ENV_ASYNC_DISPATCH, value)
        assert env.async_dispatch_mode() == mode
    monkeypatch.setenv(env.ENV_ASYNC_DISPATCH, "sometimes")
    for _ in range(2):
        with pytest.raises(ValueError, match="async dispatch.*='sometimes'"):
            env.async_dispatch_mode()
