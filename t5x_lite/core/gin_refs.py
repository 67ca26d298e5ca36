"""Reading gin's parsed configuration back: what a macro resolves to, which binding set a value.

Imports only gin, and defines no flags, so any layer may import it (the data pipeline names
the binding behind a bad value with it); `t5x_lite.core.gin_config`, which defines the
entry points' absl flags at import, re-exports `resolved_macro`.
"""

from __future__ import annotations

from typing import Any

import gin
import gin.config


def resolved_macro(value: Any) -> Any:
  """The value a gin macro evaluates to, following `%OTHER` and `%gin.REQUIRED`."""
  while isinstance(value, gin.config.ConfigurableReference) and value.evaluate:
    if value.selector not in ("gin.macro", "gin.constant"):
      return value
    value = value.scoped_configurable_fn()
  return value


def binding_name(configurable: str, parameter: str) -> str:
  """The gin binding a user edits for `parameter` of the `configurable` being called.

  Inside a call that gin makes under a scope (`@train_length/steps_for_epochs()`), the
  scoped binding and the macro it reads, if it reads one, e.g.
  "gin binding train_length/steps_for_epochs.epochs (= %EPOCHS)"; the unscoped binding
  when only that is set; outside gin, "steps_for_epochs's epochs".
  """
  scope = gin.current_scope_str()
  keys = [f"{scope}/{configurable}.{parameter}"] if scope else []
  for key in [*keys, f"{configurable}.{parameter}"]:
    try:
      value = gin.query_parameter(key)
    except ValueError:  # not bound under this key
      continue
    if isinstance(value, gin.config.ConfigurableReference) and value.selector == "gin.macro":
      return f"gin binding {key} (= %{'/'.join(value.scopes)})"
    return f"gin binding {key}"
  return f"{configurable}'s {parameter}"
