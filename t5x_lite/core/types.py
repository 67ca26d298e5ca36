"""The type names shared by the package's annotations.

One definition of each alias, imported where annotations need it (`from t5x_lite.core.types
import Array, PyTree`). Importing this module loads JAX under `TYPE_CHECKING` only, so the
core layer stays free of JAX at import time; it loads gin for `GIN_REQUIRED`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import gin

if TYPE_CHECKING:
  import jax

  Array: TypeAlias = jax.Array
else:
  Array: TypeAlias = Any

# A nested structure of containers (dict, list, tuple, dataclass) with array leaves.
PyTree: TypeAlias = Any
# Anything jnp accepts as a dtype: jnp.float32, np.dtype('bfloat16'), 'float32', ...
DType: TypeAlias = Any
Shape: TypeAlias = tuple[int, ...]
# A parameter initialiser: (rng, shape, dtype) -> array.
Initializer: TypeAlias = Callable[..., Array]
# A jax.Device. jaxlib's compiled Device class comes without a stub, so type checkers see
# `jax.Device` as an unknown variable and refuse it in annotations.
Device: TypeAlias = Any

# gin.REQUIRED typed as Any: gin defines it as a plain `object()`, which type checkers
# refuse as the default of a `str` or `int` parameter. The same object, so gin treats
# `def f(*, path: str = GIN_REQUIRED)` exactly as `= gin.REQUIRED`.
GIN_REQUIRED: Any = gin.REQUIRED
