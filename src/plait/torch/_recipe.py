"""What the mixins of a plait process group take from it: the communicator and the recipe.

:class:`~plait.torch._backend.ProcessGroupPlait` is made of mixins (the
coalesced calls, the all-to-alls) that run their calls through the group's
running recipe (``_run``, Note [sync and async calls] in
``plait.torch._backend``). :class:`GroupRecipe` declares, for the type
checker only, what they use of it, once for all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import plait
from plait.torch._staging import Staged
from plait.torch._work import PlaitWork

__all__ = ["GroupRecipe"]


class GroupRecipe:
    """The communicator and running recipe a group's mixins call (declared, not defined)."""

    _comm: plait.Communicator

    if TYPE_CHECKING:  # provided by ProcessGroupPlait

        def _describe(self, call: str) -> str: ...

        def _run(
            self,
            call: str,
            opts: Any,
            start: Callable[[bool, float | None], Any],
            outputs: Any,
            finish: Callable[[], None] | None = None,
            reword: Callable[[ValueError], ValueError] | None = None,
            back: list[Staged] | None = None,
        ) -> PlaitWork: ...
