"""A prepared cache copied from elsewhere is someone else's files: an entry's meta.json says what to allocate
and read, and the index names the entries. Forged, each is one line naming the file, never a traceback and
never an allocation the config itself would refuse."""

from __future__ import annotations

import json

import pytest
from data_helpers import write_case

from brats_swap.config import DataConfig
from brats_swap.data.cache import list_prepared, load_prepared, prepare_dataset
from brats_swap.errors import DataError

CASE = "BraTS2021_00000"


@pytest.fixture
def cache(tmp_path):
    root, cache = tmp_path / "raw", tmp_path / "cache"
    write_case(root, CASE, "2021", seed=0)
    prepare_dataset(root, cache, DataConfig(cube=[16, 16, 16], prepare_workers=1), workers=1, progress=False)
    return cache


@pytest.mark.parametrize("change, problem", [
    ({"cube": [2**20, 2**20, 2**20]}, "gives the cube as [1048576, 1048576, 1048576], not 3 sizes of 1 to 1024"),
    ({"cube": "16x16x16"}, "gives the cube as 16x16x16, not 3 sizes"),
    ({"cube": [16, 16, True]}, "not 3 sizes"),
    ({"cube": None}, "gives the cube as None"),
    ({"stored_box": [[0, 16], [0, 16], [0, 17]]}, "not 3 [start, stop] pairs inside the cube [16, 16, 16]"),
    ({"stored_box": [[5, 2], [0, 16], [0, 16]]}, "stored box"),
    ({"stored_box": "all"}, "stored box"),
    ({"modalities": list(range(4))}, "gives the modalities as [0, 1, 2, 3], not a list of 1 to 64 names"),
    ({"modalities": ["t1"] * 10_000}, "not a list of 1 to 64 names"),
    ({"image_dtype": "object"}, "gives the image dtype as 'object', not float16 or float32"),
    ({"has_label": "yes"}, "has_label"),
])
def test_a_forged_entry_is_one_line_naming_its_meta_json(cache, change, problem):
    meta_path = cache / CASE / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta.update(change)
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DataError) as caught:
        load_prepared(cache, CASE, mmap=False)
    message = str(caught.value)
    assert message.startswith(f"cache {cache}: case {CASE}: {meta_path} ") and problem in message
    assert "\n" not in message and "prepare the case again" in message


def test_an_entry_left_as_prepared_loads(cache):
    assert load_prepared(cache, CASE, mmap=False).image.shape == (4, 16, 16, 16)


def test_a_huge_or_deeply_nested_meta_json_is_not_ours_and_never_read_whole(cache):
    meta_path = cache / CASE / "meta.json"
    meta_path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DataError, match="is not prepared"):
        load_prepared(cache, CASE)
    with open(meta_path, "wb") as handle:  # 17 MiB: more than any meta.json of ours
        handle.write(b'{"a": "' + b"x" * (17 * 2**20) + b'"}')
    with pytest.raises(DataError, match="is not prepared"):
        load_prepared(cache, CASE)


@pytest.mark.parametrize("index", [
    '{"cases": [1, 2]}', '{"cases": "BraTS2021_00000"}', '{"cases": null}', "[]", '{"cases": [["../x"]]}',
])
def test_a_forged_index_is_one_line(cache, index):
    (cache / "index.json").write_text(index)
    with pytest.raises(DataError) as caught:
        list_prepared(cache)
    assert str(caught.value).startswith(f"{cache / 'index.json'}: unreadable cache index")


def test_an_index_naming_a_path_outside_the_cache_is_refused(cache):
    (cache / "index.json").write_text(json.dumps({"cases": ["../../etc"]}))
    with pytest.raises(DataError, match="case id"):
        list_prepared(cache)
    (cache / "index.json").write_text("{" * 1000 + "}" * 1000)
    with pytest.raises(DataError, match="nested more than 64 levels"):
        list_prepared(cache)


def test_a_forged_cube_is_one_line_before_a_region_run_reads_its_locations(cache):
    from brats_swap.data.class_locations import default_regions
    from brats_swap.train.data import CubeDataset

    meta_path = cache / CASE / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["cube"] = "16x16x16"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DataError, match=rf"case {CASE}: .*meta.json gives the cube as 16x16x16, not 3 sizes"):
        CubeDataset(cache, [CASE], crop=(8, 8, 8), foreground="nnunet", batch_size=2,
                    regions=default_regions("2021"))


def test_a_cache_used_alone_must_hold_the_runs_cube_and_modalities(cache, tmp_path):
    """`data.cache_only`: the entries are read as they stand, so an entry prepared for another cube (a cache
    made for another config, or a forged one that would allocate 1000³) is one line before anything is read."""
    from brats_swap.data.cache import prepare_missing

    alone = DataConfig(cube=[16, 16, 16], cache=str(cache), root=str(tmp_path / "absent"), cache_only=True)
    assert prepare_missing(alone, workers=1, progress=False).up_to_date == [CASE]
    for config, message in (
        (DataConfig(cube=[32, 32, 32], cache=str(cache), cache_only=True),
         "was prepared for cube [16, 16, 16], and this run's data.cube is [32, 32, 32]: set data.cube to the "
         "cache's, or prepare the data again"),
        (DataConfig(cube=[16, 16, 16], modalities=["t1", "t2"], cache=str(cache), cache_only=True),
         "was prepared for modalities ['t1', 't1ce', 't2', 'flair'], and this run's data.modalities is "
         "['t1', 't2']"),
    ):
        with pytest.raises(DataError) as caught:
            prepare_missing(config, workers=1, progress=False)
        assert str(caught.value).startswith(f"cache {cache}: case {CASE}: {cache / CASE / 'meta.json'} ")
        assert message in str(caught.value)
    meta_path = cache / CASE / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "cube": [1000, 1000, 1000], "stored_box": [[0, 1000]] * 3}))
    with pytest.raises(DataError, match=r"was prepared for cube \[1000, 1000, 1000\]"):
        prepare_missing(alone, workers=1, progress=False)


def test_an_altered_entry_is_prepared_again_from_the_dataset(cache, tmp_path):
    """With data.root, an entry whose cube no longer agrees with its settings is not up to date: prepared
    again from the NIfTI files, never allocated as it says."""
    meta_path = cache / CASE / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "cube": [1000, 1000, 1000], "stored_box": [[0, 1000]] * 3}))
    report = prepare_dataset(tmp_path / "raw", cache, DataConfig(cube=[16, 16, 16], prepare_workers=1), workers=1,
                             progress=False)
    assert report.prepared == [CASE]
    assert load_prepared(cache, CASE, mmap=False).image.shape == (4, 16, 16, 16)
