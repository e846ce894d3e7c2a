"""calclip.run.config_file: a YAML config is read with bounded alias expansion, no repeated keys and bounded error
messages, before TrlParser sees it (tests/test_configs.py runs the same files through ``parse_train_args``)."""

import time

import pytest

from calclip.run.config_file import MAX_EXPANDED_NODES, ConfigFileError, bounded_repr, load_config_file


def laughs(levels: int, field: str = "fp8_keep_patterns") -> str:
    """A "billion laughs" YAML: ``field`` holds anchors l0..l<levels>, each a list of 9 aliases of the one before,
    so the last stands for 9**(levels+1) strings in a file of a few hundred bytes."""
    lines = ["output_dir: out", f"{field}:", '  - &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"  - &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_nested_aliases_beyond_the_limit_are_refused_before_anything_is_built(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(laughs(9))  # 9**10 values, ~600 bytes
    assert path.stat().st_size < 1000
    started = time.perf_counter()
    with pytest.raises(ConfigFileError, match=rf"laughs.yaml: line \d+: this value expands to \d+ values or more "
                                              rf"with its aliases \(limit {MAX_EXPANDED_NODES}\)") as info:
        load_config_file(path)
    assert time.perf_counter() - started < 1.0 and len(str(info.value)) < 300


def test_aliases_within_the_limit_still_work(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("base: &eps 0.2\nepsilon: *eps\nlists: &l [1, 2]\nmore: [*l, *l]\n")
    assert load_config_file(path) == {"base": 0.2, "epsilon": 0.2, "lists": [1, 2], "more": [[1, 2], [1, 2]]}
    count = MAX_EXPANDED_NODES // 2 - 10  # the root mapping, its key and value, the list: the rest are items
    path.write_text("x: &a [" + ", ".join(["1"] * count) + "]\ny: *a\n")
    assert len(load_config_file(path)["y"]) == count


def test_a_recursive_alias_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("output_dir: out\nfp8_keep_patterns: &a [x, *a]\n")
    with pytest.raises(ConfigFileError, match=r"loop.yaml: line 2: an alias refers to a value that contains it"):
        load_config_file(path)


@pytest.mark.parametrize("text, key, lines", [
    ("max_steps: 3\nepsilon: 0.2\nmax_steps: 5\n", "'max_steps'", "lines 1 and 3"),
    ("env:\n  A: 1\n  A: 2\n", "'A'", "lines 2 and 3"),  # nested mappings too
    ("'fp8': true\nfp8: false\n", "'fp8'", "lines 1 and 2"),  # quoted or not, the same key
])
def test_a_repeated_key_is_an_error_naming_it(tmp_path, text, key, lines):
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigFileError, match=rf"twice.yaml: key {key} appears twice in one mapping \({lines}\)"):
        load_config_file(path)


def test_merge_keys_are_not_repeats(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("base: &b {epsilon: 0.2, max_steps: 3}\nrun:\n  <<: *b\n  max_steps: 5\n")
    assert load_config_file(path)["run"] == {"epsilon": 0.2, "max_steps": 5}


@pytest.mark.parametrize("text, match", [
    ("", "is empty"),
    ("- a\n- b\n", "must hold a YAML mapping of field: value, got a list"),
    ("a: [1, 2\n", "not valid YAML"),
    ("1: x\n", "field names must be strings, got 1"),
    ("a: !!python/object:os.system x\n", "not valid YAML"),  # safe tags only
    ("a: " + "[" * 1500 + "]" * 1500 + "\n", "nested too deeply|expands to"),
])
def test_other_bad_files_are_named(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigFileError, match=rf"bad.yaml.*({match})"):
        load_config_file(path)
    with pytest.raises(ConfigFileError, match="no-such.yaml: No such file"):
        load_config_file(tmp_path / "no-such.yaml")


def test_bounded_repr_is_short_and_fast_on_shared_values():
    shared = ["lol"] * 9
    for _ in range(12):  # 9**13 strings if expanded
        shared = [shared] * 9
    started = time.perf_counter()
    text = bounded_repr(shared)
    assert time.perf_counter() - started < 0.1 and len(text) <= 120 and text.startswith("[[[")
    long = bounded_repr("x" * 500)
    assert bounded_repr([0.5, "a"]) == "[0.5, 'a']" and "..." in long and len(long) <= 120
