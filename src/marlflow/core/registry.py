"""What the workflow and intervention registries share: loading a `SPEC` from a module named at run time.

`core.workflow_spec` and `core.intervention_spec` each keep their own table (built-ins, then the modules named
in their environment variable, then `register()`); this module only reads such a variable and imports such
a module, with one message per way it can go wrong.

    for mod in env_modules("MARLFLOW_WORKFLOWS"):
        register(load_spec(mod, WorkflowSpec, "MARLFLOW_WORKFLOWS", WorkflowError))
"""

from __future__ import annotations

import os
from importlib import import_module


def env_modules(var: str) -> list[str]:
    """The module names in environment variable `var`, comma-separated, blanks dropped."""
    return [m for m in (m.strip() for m in os.environ.get(var, "").split(",")) if m]


def load_spec(module: str, cls: type, where: str, error: type[Exception]):
    """`module.SPEC`, checked to be a `cls`; `error` naming `where` (what named the module) and the fix if the
    module cannot be imported, has no SPEC, or its SPEC is something else."""
    name = cls.__name__
    article = "an" if name[0] in "AEIOU" else "a"
    try:
        spec = import_module(module).SPEC
    except ModuleNotFoundError as err:
        raise error(f"{where}: module {module!r} cannot be imported ({err}); put its folder on PYTHONPATH or "
                    "fix the name") from err  # fmt: skip
    except AttributeError as err:
        raise error(f"{where}: module {module!r} has no SPEC; define SPEC = {name}(...)") from err
    if not isinstance(spec, cls):
        raise error(f"{where}: {module}.SPEC is a {type(spec).__name__}, not {article} {name}")
    return spec
