"""Small YAML files that people write (the device plugin's config, the extender's settings, simulator
fixtures), read in bounded work: a size cap before parsing, and every way PyYAML can fail on hostile
text (bad syntax, an integer past Python's 4,300-digit conversion limit, nesting past the recursion
limit) reported as one error. A YAML alias bomb parses quickly into shared references; callers must not
walk or print what they do not expect (each loader checks types first and shows values with reprlib).
"""

from __future__ import annotations

import os
import reprlib
from typing import Any

try:
    import yaml
except ImportError:  # a managed host without PyYAML: the module that reads a file says so, nothing else fails
    yaml = None  # type: ignore[assignment]

# libyaml when present: linear time and a nesting limit (the pure-Python loader raises RecursionError).
LOADER = getattr(yaml, "CSafeLoader", None) or getattr(yaml, "SafeLoader", None)


class YamlFileError(ValueError):
    """The file cannot be read, is over its size cap, or is not YAML; the message says which."""


def read_yaml(path: str | os.PathLike[str], limit: int) -> Any:
    """The parsed document of a file of at most `limit` bytes (None when empty)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise YamlFileError(f"cannot read: {exc.strerror}") from None
    except ValueError as exc:  # a NUL byte in the path
        raise YamlFileError(f"cannot read {reprlib.repr(str(path))}: {exc}") from None
    return parse_yaml(data, limit)


def parse_yaml(data: bytes | str, limit: int) -> Any:
    """The parsed document of a file's content, held to the same rules as :func:`read_yaml` (text counts in
    UTF-8 bytes): what a file of this content would give, without the file."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    if len(data) > limit:
        raise YamlFileError(f"larger than {limit} bytes")
    if yaml is None:
        raise YamlFileError("cannot be parsed: this Python has no PyYAML (install python3-yaml)")
    try:
        return yaml.load(data, Loader=LOADER)
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: an integer of more than 4300 digits
        raise YamlFileError(f"not valid YAML: {exc}") from None
    except RecursionError:
        raise YamlFileError("not valid YAML: nested too deeply") from None
