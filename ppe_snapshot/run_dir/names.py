"""A snapshot filename format (``"snapshot_iter_{.iteration}"``) turned into a matcher of names.

The snapshot extension names its snapshots by formatting the manager into
the format string; here the names are parsed back: which names under the
output directory the format makes, and the training position their fields
hold.
"""
from __future__ import annotations

import re
import string

# Regular expressions for the manager attributes a filename format usually holds.
_FIELD_PATTERNS = {
    "iteration": r"\d+",
    "epoch": r"\d+",
    "execution": r"\d+",
    "epoch_detail": r"\d+(?:\.\d*)?(?:[eE][-+]?\d+)?",
}
_ANY = r"[^/]+?"


class FilenameFormat:
    """A filename format string (``"snap/iter_{.iteration:06d}"``) turned into a matcher.

    Each ``/``-separated component becomes one regular expression; replacement
    fields become groups, and the manager attribute they name (``iteration``,
    ``epoch``, ``epoch_detail``) is parsed back from a matching name.
    """

    def __init__(self, fmt: str) -> None:
        if not isinstance(fmt, str):
            raise TypeError(f"a filename format must be a str, got {type(fmt).__name__}")
        try:
            tokens = list(string.Formatter().parse(fmt))
        except ValueError as e:
            raise ValueError(f"filename {fmt!r} is not a valid format string: {e}") from None
        self.fmt = fmt
        components: list[tuple[str, list[str | None]]] = [("", [])]
        for literal, field, _spec, _conversion in tokens:
            pieces = literal.split("/")
            for i, piece in enumerate(pieces):
                if i:
                    components.append(("", []))
                pattern, attrs = components[-1]
                components[-1] = (pattern + re.escape(piece), attrs)
            if field is not None:
                attr = _attribute(field)
                pattern, attrs = components[-1]
                components[-1] = (pattern + f"({_FIELD_PATTERNS.get(attr or '', _ANY)})", attrs + [attr])
        if any(not pattern for pattern, _ in components):
            raise ValueError(f"filename {fmt!r} has an empty path component")
        self._components = [(re.compile(pattern), attrs) for pattern, attrs in components]

    @property
    def fixed(self) -> bool:
        """Whether the format has no replacement fields: it names one snapshot, saved again and again."""
        return not any(attrs for _, attrs in self._components)

    @property
    def depth(self) -> int:
        """The number of path components of a matching name."""
        return len(self._components)

    def match_component(self, level: int, name: str) -> dict[str, str] | None:
        """The field values of path component ``level`` of a name, or None when it does not match."""
        regex, attrs = self._components[level]
        m = regex.fullmatch(name)
        if m is None:
            return None
        values: dict[str, str] = {}
        for attr, value in zip(attrs, m.groups()):
            if attr is not None:
                values.setdefault(attr, value)
        return values

    def match(self, name: str) -> dict[str, str] | None:
        """The field values of a relative name (``"snap/iter_10"``), or None when it does not match."""
        parts = name.split("/")
        if len(parts) != self.depth:
            return None
        values: dict[str, str] = {}
        for level, part in enumerate(parts):
            found = self.match_component(level, part)
            if found is None:
                return None
            for k, v in found.items():
                values.setdefault(k, v)
        return values


def _attribute(field: str) -> str | None:
    """The manager attribute a replacement field reads (``".iteration"`` -> ``"iteration"``)."""
    if "[" in field or "." not in field:
        return None
    return field.rsplit(".", 1)[1] or None


def position_in_name(values: dict[str, str]) -> tuple[int | None, float | None]:
    """(iteration, epoch detail) from the field values of a matching name; None where it holds none."""
    iteration = int(values["iteration"]) if "iteration" in values else None
    if "epoch_detail" in values:
        epoch_detail: float | None = float(values["epoch_detail"])
    elif "epoch" in values:
        epoch_detail = float(values["epoch"])
    else:
        epoch_detail = None
    return iteration, epoch_detail
