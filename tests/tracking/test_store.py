"""The store's public helpers: filter quoting, tag filters, and what a TrackingError is to `vitp`."""
import pytest

from vitp.errors import UserError
from vitp.tracking.store import TrackingError, quote, tag_filters


def test_quote_picks_the_quote_the_value_lacks():
    assert quote("run-1") == "'run-1'"
    assert quote("it's") == '"it\'s"'
    with pytest.raises(TrackingError, match="both ' and \""):
        quote("it's \"x\"")


def test_tag_filters_match_every_tag_and_the_sweep():
    assert tag_filters(None, None) == []
    assert tag_filters("s1", {"dataset": "digits"}) == ["tags.`dataset` = 'digits'", "tags.`sweep` = 's1'"]


def test_tracking_errors_are_user_errors_exit_2():
    assert issubclass(TrackingError, UserError) and issubclass(TrackingError, RuntimeError)
    assert TrackingError("x").exit_code == 2
