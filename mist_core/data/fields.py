"""A corpus row's fields as the adapters read them: the first of several column names,
the row's id, a text value; each refusal an InvalidExample with its reason."""
from __future__ import annotations

from typing import Mapping

from ..errors import InvalidExample


def first_field(row: Mapping, *names: str) -> object:
    """The value of the first of `names` the row holds (not None); missing_column if none."""
    for name in names:
        if name in row and row[name] is not None:
            return row[name]
    raise InvalidExample("missing_column", f"needs one of {list(names)}, row has {sorted(row)}")


def row_id(row: Mapping, column: str = "id") -> str | None:
    """The row's id as a string (an int is written out), None if it has none; a blank or
    non-scalar id is refused."""
    value = row.get(column)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InvalidExample("id_not_string", f"got {type(value).__name__}")
    if isinstance(value, str) and not value.strip():
        # A blank id names nothing: every such row would share it and all but the first
        # would be dropped as duplicates.
        raise InvalidExample("empty_id", "")
    return str(value)


def text_field(value: object, field: str) -> str:
    """`value` if it is a string; `<field>_not_string` otherwise."""
    if not isinstance(value, str):
        raise InvalidExample(f"{field}_not_string", f"got {type(value).__name__}")
    return value
