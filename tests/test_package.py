"""The package's top level: the names users reach for, the same objects as in their homes."""

import importlib

import mhc

HOMES = {
    "mhc.layer": ["FusedMHC", "sinkhorn"],
    "mhc.mixing": [
        "HyperConnection",
        "LaneMixer",
        "StreamCollapse",
        "StreamExpand",
        "expand_streams",
        "reduce_streams",
    ],
    "mhc.memory.recompute": ["recompute_streams"],
    "mhc.memory.checkpoint": ["checkpoint_layers", "checkpoint_policy"],
    "mhc.losses": ["LinearCrossEntropy", "linear_cross_entropy"],
}


def test_top_level_names_are_their_homes_objects():
    for module, names in HOMES.items():
        home = importlib.import_module(module)
        for name in names:
            assert getattr(mhc, name) is getattr(home, name), (module, name)
            assert name in home.__all__ and name in mhc.__all__, (module, name)


def test_all_lists_only_what_exists():
    assert all(hasattr(mhc, name) for name in mhc.__all__)
    assert len(set(mhc.__all__)) == len(mhc.__all__)
