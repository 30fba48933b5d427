"""The shipped job configs load, and bad configs fail in one line naming the key at fault."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import yaml

from app.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "jobs" / "configs"
TINY = CONFIGS / "tiny-cpu.yaml"


def write_variant(tmp_path: Path, change: Callable[[dict], None]) -> Path:
    """tiny-cpu.yaml with one change applied, written next to the test."""
    tree = yaml.safe_load(TINY.read_text())
    change(tree)
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def config_error(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_shipped_configs_are_all_here():
    assert {"tiny-cpu.yaml", "llama3-8b-lora.yaml", "llama3-70b-lora.yaml", "tiny-dpo.yaml",
            "llama3-8b-dpo.yaml"} <= {p.name for p in CONFIGS.glob("*.yaml")}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.name == path.stem


def test_tiny_cpu_fits_the_two_core_machine():
    cfg = load_config(TINY)
    assert (cfg.scaling.min_workers, cfg.scaling.max_workers, cfg.scaling.use_gpu) == (2, 2, False)
    assert cfg.scaling.min_workers * cfg.scaling.cpus_per_worker <= 2
    assert cfg.model.uri == "s3://eft/models/tiny-llama" and cfg.run_uri == "s3://eft/runs/tiny-cpu"


def test_unknown_key_is_named(tmp_path):
    path = write_variant(tmp_path, lambda t: t["training"].update(lr_typo=0.1))
    message = config_error(path)
    assert "training.lr_typo" in message and "unknown key" in message and str(path) in message


def test_wrong_type_is_named(tmp_path):
    path = write_variant(tmp_path, lambda t: t["training"].update(max_steps="many"))
    assert "training.max_steps" in config_error(path)


def test_missing_required_key_is_named(tmp_path):
    path = write_variant(tmp_path, lambda t: t["model"].pop("uri"))
    message = config_error(path)
    assert "model.uri" in message and "required" in message.lower()


def test_min_workers_above_max_workers_is_named(tmp_path):
    path = write_variant(tmp_path, lambda t: t["scaling"].update(min_workers=3, max_workers=2))
    assert "scaling.min_workers (3) > scaling.max_workers (2)" in config_error(path)


def test_indivisible_global_batch_names_the_world_size(tmp_path):
    # 8 sequences split at 2 workers x 2, but not at 3 workers x 2.
    path = write_variant(tmp_path, lambda t: t["scaling"].update(min_workers=2, max_workers=3))
    message = config_error(path)
    assert "training.global_batch_size" in message and "world size 3" in message
    assert "pad_uneven_batches" in message  # names the way out


def test_padding_allows_any_world_size_with_a_row_for_each_worker(tmp_path):
    padded = lambda t: (t["scaling"].update(min_workers=2, max_workers=3),  # noqa: E731
                        t["training"].update(pad_uneven_batches=True))
    assert load_config(write_variant(tmp_path, padded)).training.pad_uneven_batches
    too_small = lambda t: (t["scaling"].update(min_workers=2, max_workers=9),  # noqa: E731
                           t["training"].update(pad_uneven_batches=True))
    assert "9 workers" in config_error(write_variant(tmp_path, too_small))


def test_overrides_parse_to_typed_values():
    cfg = load_config(TINY, ["training.max_steps=5", "lora.r=4", "training.lr=1.0e-4"])
    assert cfg.training.max_steps == 5 and cfg.lora.r == 4 and cfg.training.lr == pytest.approx(1e-4)


def test_override_can_turn_lora_off():
    assert load_config(TINY, ["lora=null"]).lora is None


def test_override_of_an_unknown_key_is_named():
    assert "training.lr_typo" in config_error(TINY, ["training.lr_typo=1"])


def test_override_without_a_value_is_rejected():
    assert "training.max_steps" in config_error(TINY, ["training.max_steps"])


def test_override_into_a_scalar_is_rejected():
    assert "'max_steps' is not a section" in config_error(TINY, ["training.max_steps.x=1"])


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.yaml"
    assert str(missing) in config_error(missing)


# Values that used to pass the config and fail later: on the workers after the run had written
# objects, or (a root of "/" or "") by training happily into the filesystem root or the current
# directory. Each is now one line at load, naming the key.
@pytest.mark.parametrize("sets, named", [
    (["training.seed=-1"], ["training.seed", "greater than or equal to 0"]),
    (["lora.target_modules=[]"], ["lora.target_modules", "empty"]),
    (["lora.target_modules=[q_proj, ' ']"], ["lora.target_modules", "a module name is empty"]),
    (["storage.root_uri="], ["storage.root_uri", "valid string"]),  # YAML null
    (["storage.root_uri=''"], ["storage.root_uri", "empty"]),
    (["storage.root_uri=/"], ["storage.root_uri", "'/' is the filesystem root"]),
    (["storage.root_uri=file:///"], ["storage.root_uri", "filesystem root"]),
    (["storage.root_uri=."], ["storage.root_uri", "'.'"]),
    (["storage.root_uri=./"], ["storage.root_uri", "'./'"]),
    (["storage.root_uri=s3://"], ["storage.root_uri", "names no bucket"]),
    (["storage.root_uri=s3:///runs"], ["storage.root_uri", "names no bucket"]),
    (["data.uri=''"], ["data.uri", "empty"]),
    (["scaling.resources_per_worker={CPU: 1}"], ["scaling.resources_per_worker", "'CPU'", "scaling.cpus_per_worker"]),
    (["scaling.resources_per_worker={gpu: 1}"], ["scaling.resources_per_worker", "'gpu'", "scaling.gpus_per_worker"]),
    (["scaling.resources_per_worker={trn1: -1}"], ["scaling.resources_per_worker", "'trn1'", "negative"]),
    (["scaling.elastic_resize_monitor_interval_s=0"], ["scaling.elastic_resize_monitor_interval_s", "greater than 0"]),
], ids=lambda v: v[0] if isinstance(v, list) and v and "=" in v[0] else None)
def test_values_that_used_to_fail_late_are_named_at_load(sets, named):
    message = config_error(TINY, sets)
    assert str(TINY) in message
    for words in named:
        assert words in message, message


@pytest.mark.parametrize("data_uri, root_uri", [
    ("s3://eft/runs/pydoc", "s3://eft/runs"),  # the dataset inside the runs
    ("s3://eft/data/pydoc", "s3://eft/data/"),  # the runs hold the dataset (trailing slash)
    ("s3://eft/data/pydoc", "s3://eft"),  # the whole bucket
    ("s3://eft/data//pydoc/", "s3://eft/data/pydoc"),  # the same prefix, spelt differently
    ("{tmp}/a/data", "file://{tmp}/a//"),  # a path and a file:// URI of its parent
    ("data/pydoc", "data"),  # relative paths, from the current directory
])
def test_overlapping_data_and_run_prefixes_are_named(tmp_path, data_uri, root_uri):
    sets = [f"data.uri={data_uri.format(tmp=tmp_path)}", f"storage.root_uri={root_uri.format(tmp=tmp_path)}"]
    message = config_error(TINY, sets)
    assert f"data.uri {data_uri.format(tmp=tmp_path)} and storage.root_uri {root_uri.format(tmp=tmp_path)} overlap" \
        in message


@pytest.mark.parametrize("data_uri, root_uri", [
    ("s3://eft/data", "s3://eft/data2"),  # a shared string prefix is not a shared tree
    ("s3://eft/runs2/pydoc", "s3://eft/runs"),
    ("s3://other/data", "s3://eft/data"),
    ("{tmp}/data", "{tmp}/data-runs"),
    ("s3://eft/data", "{tmp}/data"),  # another store altogether
])
def test_neighbouring_data_and_run_prefixes_load(tmp_path, data_uri, root_uri):
    cfg = load_config(TINY, [f"data.uri={data_uri.format(tmp=tmp_path)}",
                             f"storage.root_uri={root_uri.format(tmp=tmp_path)}"])
    assert cfg.run_uri.endswith("/tiny-cpu")


@pytest.mark.parametrize("root", ["/", "", "."])
def test_train_with_a_root_of_slash_empty_or_dot_stops_at_the_config(root, capsys, tmp_path, monkeypatch):
    """What a new user tried: `/` trained into /tiny-cpu and `""` into the current directory, both
    exiting 0. Now `eft train` stops in one line naming the key, before storage or Ray is touched."""
    from app.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", str(TINY), "--set", f"storage.root_uri='{root}'"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"eft: error: {TINY}: storage.root_uri: ")
    assert list(tmp_path.iterdir()) == []  # nothing in the current directory


@pytest.mark.parametrize("uri", ["hf://justone", "hf://", "hf://a/b/c", "hf://org/name@", "hf://-org/name",
                                 "hf://org/na me", "hf://org//name"])
def test_a_malformed_hub_id_is_refused_by_every_command_in_one_line(uri, capsys):
    """`eft config` printed `model.uri: hf://justone` and exited 0, and `eft plan` then refused it:
    the hub id's syntax is the config's, so `config` (and every command) refuses it."""
    from app.cli import main

    message = config_error(TINY, [f"model.uri={uri}"])
    assert f"model.uri: {uri} is not a hub id (hf://ORG/NAME or hf://ORG/NAME@REVISION)" in message
    assert main(["config", str(TINY), "--set", f"model.uri={uri}"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert line.startswith(f"eft: error: {TINY}: model.uri: {uri} is not a hub id")


@pytest.mark.parametrize("uri", ["hf://org/name", "hf://Org-1/name.v2_x", "hf://org/name@main",
                                 "hf://org/name@0123456789abcdef0123456789abcdef01234567", "hf://org/name/"])
def test_a_well_formed_hub_id_loads(uri):
    from app.hub import parse_hub_uri

    assert load_config(TINY, [f"model.uri={uri}"]).model.uri == uri
    parse_hub_uri(uri)  # the hub's own parser reads it too
