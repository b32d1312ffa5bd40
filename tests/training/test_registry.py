"""Every registry refuses a second class under a taken name and names the part on each class."""

import pytest

from training._registry import make_register
from training.datasets import DATASETS, register_dataset
from training.generators import GENERATORS, register_generator
from training.losses import LOSSES, register_loss
from training.schedules import SCHEDULES, register_schedule


@pytest.mark.parametrize(
    "registry,register",
    [
        (DATASETS, register_dataset),
        (GENERATORS, register_generator),
        (LOSSES, register_loss),
        (SCHEDULES, register_schedule),
    ],
)
def test_taken_names_are_refused_and_classes_named(registry, register):
    name, cls = next(iter(registry.items()))
    assert cls.name == name
    with pytest.raises(ValueError, match=f"{name!r} is already registered"):
        register(name)(type("Other", (), {}))


def test_same_class_again_only_where_allowed():
    strict, lenient = {}, {}
    cls = type("Part", (), {})
    make_register(strict, "part")("p")(cls)
    with pytest.raises(ValueError):
        make_register(strict, "part")("p")(cls)
    make_register(lenient, "part", allow_same=True)("p")(cls)
    assert make_register(lenient, "part", allow_same=True)("p")(cls) is cls and lenient == {"p": cls}
