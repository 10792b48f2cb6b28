"""Writes shmcache/_native/hot_params_gen.h, the C side of ``layout.HOT_PARAMS``.

    python -m shmcache.shm.hot_params_gen > shmcache/_native/hot_params_gen.h

The header gives each row of ``layout.HOT_PARAMS`` its index in the tuple
``_hot.Hot`` takes (``P_<NAME>``, in the table's order), the count
(``P_COUNT``) and the names (``hot_param_names``, which the binding exposes
as ``_hot.PARAM_NAMES``). The generated file is committed, so building the
extension needs neither Python's numpy nor this package;
tests/test_hot_params_gen.py fails while it differs from what this writes.
"""

from __future__ import annotations

import sys

from .layout import HOT_PARAMS

COMMAND = "python -m shmcache.shm.hot_params_gen > shmcache/_native/hot_params_gen.h"


def header() -> str:
    """The text of hot_params_gen.h for the current ``layout.HOT_PARAMS``."""
    width = max(len(name) for name, _, _ in HOT_PARAMS) + len("P_,")
    enum = "\n".join(f"    {f'P_{name.upper()},':<{width}}  /* {i}: {doc} */"
                     for i, (name, _, doc) in enumerate(HOT_PARAMS))
    names = "\n".join(f'    "{name}",' for name, _, _ in HOT_PARAMS)
    return f"""\
/* shmcache/_native/hot_params_gen.h: GENERATED from shmcache/shm/layout.py's
 * HOT_PARAMS by
 *     {COMMAND}
 * Do not edit: change HOT_PARAMS and run that command (then rebuild).
 *
 * The index of each parameter in the tuple Hot() takes (hot_params.h's
 * HotCore.p), and their names, in HOT_PARAMS' order. */
#ifndef SHMCACHE_HOT_PARAMS_GEN_H
#define SHMCACHE_HOT_PARAMS_GEN_H

enum {{
{enum}
    P_COUNT
}};

static const char *const hot_param_names[P_COUNT] = {{
{names}
}};

#endif
"""


def main() -> int:
    sys.stdout.write(header())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
