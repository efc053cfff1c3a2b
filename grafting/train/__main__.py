"""``python -m grafting.train ...`` and ``accelerate launch -m grafting.train train --config ...``: the
``chimera graft`` command line without the rest of ``chimera``."""

from .cli import graft_app

graft_app()
