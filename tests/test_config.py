"""RINGFLEX_* settings: each bad value is refused with the variable's name and what it takes."""
import pytest

from ringflex import config

BAD = {"RINGFLEX_DEBUG": ("yes", "one of 0, 1"), "RINGFLEX_TRANSPORT": ("shm", "one of auto, copy-engine, nccl"),
       "RINGFLEX_LENDING": ("on", "one of auto, 1, 0"), "RINGFLEX_MIN_TILE": ("abc", "a whole number of rows >= 1"),
       "RINGFLEX_STRAGGLER_S": ("inf", "a number of seconds >= 0"), "RINGFLEX_AGREEMENT": ("shm", "one of auto, gloo"),
       "RINGFLEX_CUDNN_GRAPHS": ("0", "a whole number of graphs >= 1")}


def test_every_setting_is_listed_once():
    assert sorted(s.name for s in config.SETTINGS) == sorted(BAD)


@pytest.mark.parametrize("setting", config.SETTINGS, ids=lambda s: s.name)
def test_a_bad_value_names_the_variable_and_what_it_takes(setting, monkeypatch):
    value, takes = BAD[setting.name]
    monkeypatch.setenv(setting.name, value)
    message = f"{setting.name}={value!r}: expected {takes}"
    with pytest.raises(ValueError) as raised:
        setting.value()
    assert str(raised.value) == message
    assert config.errors() == [message]


@pytest.mark.parametrize("setting", config.SETTINGS, ids=lambda s: s.name)
def test_defaults_parse(setting, monkeypatch):
    monkeypatch.delenv(setting.name, raising=False)
    assert setting.value() == setting.parse(setting.default)
    assert config.errors() == []


def test_debug_mode_reads_a_bad_value_as_off(monkeypatch):
    """The argument check refuses such a call: the debug mode must not start before it does."""
    monkeypatch.setenv("RINGFLEX_DEBUG", "yes")
    assert not config.debugging()
    monkeypatch.setenv("RINGFLEX_DEBUG", "1")
    assert config.debugging()


def test_a_warning_names_the_line_that_called_ringflex():
    """``warn_once``'s warnings name the caller's line, not ringflex's own frames nor those of
    the torch and contextlib decorators around its entry points."""
    import warnings

    import torch

    import ringflex

    class Masks:
        def causal(self, b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

    q = torch.randn(1, 1, 8, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ringflex.ring_flex_attention(q, q, q, mask_mod=Masks().causal, backend="reference")
    bound = [w for w in caught if "is a bound method" in str(w.message)]
    assert len(bound) == 1 and bound[0].filename == __file__, [(w.filename, w.lineno) for w in caught]
