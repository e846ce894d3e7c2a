"""Reading a ``calclip train`` YAML config: safe tags only, bounded, strict about repeated keys.

``yaml.safe_load`` alone has two traps for a config that may come from anywhere:

- aliases: ``&a [...]`` and ``*a`` let a 400-byte file stand for 10**6 values or more (a "billion laughs").
  PyYAML shares the aliased objects, so loading is cheap, but everything that walks or prints the value
  afterwards (a field check's error message, ``str()`` in TrlParser's unknown-key list) expands it: minutes and
  gigabytes for a short file. Here every alias counts as the whole subtree it stands for, and a document whose
  expanded size exceeds ``MAX_EXPANDED_NODES`` is refused before anything is built from it; an alias inside its
  own anchor (a recursive value) is refused too. Aliases within the limit keep working.
- repeated keys: YAML says a key is unique within a mapping, PyYAML keeps the last value silently. A key given
  twice is an error naming it and both lines. (``<<`` merge keys are not repeats: explicit keys override merged
  ones, as YAML's merge type defines.)

``load_config_file`` runs before TrlParser reads the same file (which then sees a checked document).
"""

from __future__ import annotations

import os

import yaml

# A config is a flat mapping of a few dozen fields (configs/ holds 20-60); lists (reward_weights,
# fp8_keep_patterns) have a handful of items. 10,000 values is far above any real config and far below what
# makes an expanded value slow to print (~1 ms).
MAX_EXPANDED_NODES = 10_000
MAX_CONFIG_BYTES = 1 << 20
_MERGE_TAG = "tag:yaml.org,2002:merge"


class ConfigFileError(ValueError):
    """A config file that cannot be read as a calclip config; the message names the file (and line)."""


def load_config_file(path: str | os.PathLike) -> dict:
    """The YAML mapping in ``path``, after the checks above; ConfigFileError naming the file otherwise."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        if size > MAX_CONFIG_BYTES:
            raise ConfigFileError(f"config file {path}: {size} bytes, more than a config needs (limit "
                                  f"{MAX_CONFIG_BYTES})")
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise ConfigFileError(f"config file {path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise ConfigFileError(f"config file {path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise ConfigFileError(f"config file {path} is empty; it must hold a YAML mapping of field: value")
        _check_node_graph(node, path)
        config = loader.construct_document(node)
    except yaml.YAMLError as error:
        raise ConfigFileError(f"config file {path}: not valid YAML: {error}") from None
    except RecursionError:
        raise ConfigFileError(f"config file {path}: values nested too deeply for a config") from None
    finally:
        loader.dispose()
    if not isinstance(config, dict):
        raise ConfigFileError(f"config file {path} must hold a YAML mapping of field: value, got a "
                              f"{type(config).__name__}")
    bad_keys = [key for key in config if not isinstance(key, str)]
    if bad_keys:
        raise ConfigFileError(f"config file {path}: field names must be strings, got {bounded_repr(bad_keys[0])}")
    return config


def _line(node) -> int:
    return node.start_mark.line + 1


def _check_node_graph(root, path: str) -> None:
    """Expanded size (aliases counted in full) <= MAX_EXPANDED_NODES, no recursive alias, no repeated key."""
    sizes: dict[int, int] = {}
    in_progress: set[int] = set()

    def size(node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in in_progress:
            raise ConfigFileError(f"config file {path}: line {_line(node)}: an alias refers to a value that "
                                  "contains it (a recursive value)")
        in_progress.add(key)
        if isinstance(node, yaml.MappingNode):
            _check_repeated_keys(node, path)
            total = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(item) for item in node.value)
        else:
            total = 1
        in_progress.discard(key)
        sizes[key] = total
        if total > MAX_EXPANDED_NODES:
            raise ConfigFileError(
                f"config file {path}: line {_line(node)}: this value expands to {total} values or more with its "
                f"aliases (limit {MAX_EXPANDED_NODES}); a config needs far fewer")
        return total

    size(root)


def _check_repeated_keys(node, path: str) -> None:
    seen: dict[tuple[str, str], int] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
            continue
        key = (key_node.tag, key_node.value)
        if key in seen:
            raise ConfigFileError(f"config file {path}: key {bounded_repr(key_node.value)} appears twice in one "
                                  f"mapping (lines {seen[key]} and {_line(key_node)}); keep one")
        seen[key] = _line(key_node)


def bounded_repr(value, limit: int = 120) -> str:
    """repr(value) cut to about ``limit`` characters without building the whole repr: nested containers print a
    few items per level and a few levels deep (reprlib), so a shared or huge value costs microseconds."""
    import reprlib

    short = reprlib.Repr()  # attributes, not keywords: Python < 3.12
    short.maxlevel, short.maxstring, short.maxlong, short.maxother = 3, limit, 40, limit
    short.maxtuple = short.maxlist = short.maxdict = short.maxset = short.maxfrozenset = short.maxdeque = 6
    text = short.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
