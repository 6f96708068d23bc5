"""The one lazy registry every family of implementations uses (KV backends, routing policies, the
router's worker clients and the operator's role renderers per runtime): an unknown name is refused
naming the known ones, and a module is imported only when its name is chosen."""

from __future__ import annotations

import sys

import pytest
from tandem.contracts.lazy_registry import check_name, resolve

TABLE = {"json": "json:dumps", "never": "tandem_no_such_module_anywhere:thing"}


def test_an_unknown_name_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown widget 'yaml'; known: \['json', 'never'\]"):
        check_name(TABLE, "yaml", "widget")
    with pytest.raises(ValueError, match="unknown widget"):
        resolve(TABLE, "yaml", "widget")


def test_only_the_chosen_module_is_imported():
    import json

    assert resolve(TABLE, "json", "widget") is json.dumps
    assert "tandem_no_such_module_anywhere" not in sys.modules  # registered, never chosen
    with pytest.raises(ImportError):
        resolve(TABLE, "never", "widget")
