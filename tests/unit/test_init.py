"""`kfac_stream`'s own namespace: every name in ``__all__`` resolves, and a renamed public name
still answers, with a FutureWarning naming its new name."""

import warnings

import pytest

import kfac_stream


def test_every_exported_name_resolves():
    missing = [name for name in kfac_stream.__all__ if getattr(kfac_stream, name, None) is None]
    assert not missing


def test_whole_model_is_gather_model_with_a_warning():
    with pytest.warns(FutureWarning, match="whole_model is now kfac_stream.gather_model"):
        old = kfac_stream.whole_model
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name warns about nothing
        assert old is kfac_stream.gather_model
    assert old.__module__ == "kfac_stream.integrations.unshard"


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'whole_modle'"):
        kfac_stream.whole_modle  # noqa: B018
