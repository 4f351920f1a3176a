"""The core pool's three levels only add to each other (docs/architecture.md,
"The core pool is one object in three files"): a level that redefined a
method of a level below would change a path the lower level's own callers
and invariants count on, which a reader of that file would not see."""

from kvelastic.core.books import PoolBooks
from kvelastic.core.handon import HandOnPool
from kvelastic.core.pool import SlabPool

LEVELS = (PoolBooks, HandOnPool, SlabPool)


def own_names(cls: type) -> set[str]:
    return {name for name in vars(cls) if not (name.startswith("__") and name.endswith("__"))}


def redefinitions(levels: tuple[type, ...]) -> dict[str, list[str]]:
    """Each level's names that a level below it defines already."""
    found = {}
    for upper in range(1, len(levels)):
        below = set().union(*(own_names(cls) for cls in levels[:upper]))
        if own_names(levels[upper]) & below:
            found[levels[upper].__name__] = sorted(own_names(levels[upper]) & below)
    return found


def test_no_level_of_the_pool_redefines_a_name_of_a_level_below():
    assert redefinitions(LEVELS) == {}


def test_the_levels_form_one_chain():
    assert SlabPool.__mro__[1:4] == (HandOnPool, PoolBooks, object)


def test_the_check_sees_a_redefinition_at_any_level():
    """Not vacuous: a top level that overrides the hot path, or one that
    redefines a shared move of the books, is caught."""
    class Overriding(SlabPool):
        def allocate(self, n):
            return super().allocate(n)

        def _drop_key(self, blk):
            return super()._drop_key(blk)

    assert redefinitions((*LEVELS, Overriding)) == {"Overriding": ["_drop_key", "allocate"]}
