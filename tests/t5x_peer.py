"""Where the tests find T5X itself: the interpreter of the peer's virtualenv.

`bash ../shared/peers/install_t5x.sh $HOME/t5x_peer` makes it; T5X_PEER_PYTHON names
another. Tests that run T5X are marked `needs_t5x_peer` and skip, saying so, without it.
"""

from __future__ import annotations

import os

import pytest

PEER_PYTHON = os.environ.get("T5X_PEER_PYTHON", os.path.expanduser("~/t5x_peer/venv/bin/python"))

needs_t5x_peer = pytest.mark.skipif(
  not os.path.exists(PEER_PYTHON),
  reason=f"T5X peer not installed at {PEER_PYTHON}: bash ../shared/peers/install_t5x.sh "
  "$HOME/t5x_peer (or set T5X_PEER_PYTHON)",
)
