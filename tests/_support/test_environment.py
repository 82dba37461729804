"""Environment variables (``_support/environment.py``): each value is parsed once
per change, and a bad one is never remembered, so every call fails on it; every
``JAX_THREADMAP_*`` variable is checked at import. And removed public names
(``_support/removed.py``): each says what replaced it, as long as CHANGELOG.md
lists it as removed."""

import re

import pytest
from helpers import ROOT, run_script

import jax_threadmap as jtm
from jax_threadmap._support import environment as env
from jax_threadmap._support import removed

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


def test_every_variable_is_checked_by_the_import_check(monkeypatch):
    for name in env.READERS:
        monkeypatch.setenv(name, "lots")
        # The variable, the value and the accepted ones (a positive integer, or
        # one of the flag's words).
        match = f"{name} (must be a positive|turns on .*must be one of).*{name}='lots'"
        with pytest.raises(ValueError, match=match):
            env.check_environment()
        monkeypatch.delenv(name)
    env.check_environment()  # (conftest's pool size, valid)


def test_the_api_page_lists_every_variable_read():
    page = (ROOT / "docs" / "api-threads.md").read_text()
    assert set(re.findall(r"^\| `(JAX_THREADMAP_\w+)`", page, re.M)) == set(env.READERS)


def test_import_fails_on_a_bad_value_and_warns_once_of_each_unknown_name():
    # One fresh interpreter: the unknown names sort before the bad value, so
    # their warnings come first; the test suite's own prefix is not warned of.
    ran = run_script(
        "import jax_threadmap",
        flags=("-W", "always"),
        env={
            "JAX_THREADMAP_MAX_IN_FLIGHT": "8",
            "JAX_THREADMAP_NUM_THREDS": "2",
            "JAX_THREADMAP_TEST_ANYTHING": "1",
            "JAX_THREADMAP_PROGRESS": "maybe",
        },
    )
    assert ran.returncode != 0, ran.report
    err = ran.stderr
    assert re.search(
        r"ValueError: The environment variable JAX_THREADMAP_PROGRESS .* must be one "
        r"of 1, true, yes, on, 0, false, no, off\. Got JAX_THREADMAP_PROGRESS='maybe'",
        err,
    ), ran.report
    warned = re.findall(r"ignores the environment variable (\w+)", err)
    assert warned == ["JAX_THREADMAP_MAX_IN_FLIGHT", "JAX_THREADMAP_NUM_THREDS"], err
    assert "removed (pass max_in_flight=N" in err, err
    assert f"it reads {', '.join(env.READERS)}" in err, err


def _changelog_removed() -> str:
    """The text of every "Removed" section of CHANGELOG.md."""
    text = (ROOT / "CHANGELOG.md").read_text()
    return "\n".join(
        re.findall(r"^\*\*Removed\*\*\n(.*?)(?=^\*\*|^#)", text, re.M | re.S)
    )


def test_each_removed_name_says_what_replaced_it():
    listed = set(re.findall(r"`([A-Za-z_][\w.]*?)(?:\(\))?`", _changelog_removed()))
    names = set()
    for token in listed:
        name = token.removeprefix("jax_threadmap.")
        head = name.split(".")[0]
        if token.startswith("JAX_THREADMAP_"):
            assert token in env.READERS or token in env.REMOVED, token
        elif (name != token or head in jtm.__all__) and name.count(".") <= 1:
            names.add(name)
    gone = set()
    for name in names:
        owner, _, attr = name.rpartition(".")
        try:
            getattr(getattr(jtm, owner) if owner else jtm, attr)
        except AttributeError as e:
            gone.add(name)
            assert name in removed.REMOVED, f"{name}: add what replaced it to REMOVED"
            assert (
                str(e) == f"jax_threadmap.{name} was removed: {removed.REMOVED[name]}."
            )
    # The tables keep a name only as long as the CHANGELOG lists it as removed.
    assert set(removed.REMOVED) == gone, (set(removed.REMOVED), gone)
    assert set(env.REMOVED) <= listed, env.REMOVED
    with pytest.raises(AttributeError, match="has no attribute 'not_a_name'"):
        jtm.not_a_name  # noqa: B018
