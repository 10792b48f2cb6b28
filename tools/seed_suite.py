"""vllm-mlx 0.6.0's own paged-cache tests, from its released sdist, run over
the seed module and over a shmcache pool (``make seed-test``).

``python -m tools.seed_suite prepare SDIST DIR`` copies
``tests/test_paged_cache.py`` and ``tests/test_paged_cache_benefits.py``
out of the sdist into DIR, less their module-level Apple-only skip (they
run on Linux: the modules they test are pure Python over MLX arrays). Each
skip is removed by matching its exact text, so an sdist whose files differ
fails here with the file named, instead of running something else.

Running them (``tools.seed_suite_plugin`` picks the manager):

    SHMCACHE_SEED_SUITE=pool PYTHONPATH=. .venv-seed/bin/python -m pytest \\
        -p tools.seed_suite_plugin .venv-seed/seed-tests
"""

from __future__ import annotations

import sys
import tarfile
from pathlib import Path

FILES = ("tests/test_paged_cache.py", "tests/test_paged_cache_benefits.py")

# file -> the exact module-level skip to drop
APPLE_ONLY = {
    "tests/test_paged_cache.py": (
        '# Skip all tests if not on Apple Silicon\n'
        'pytestmark = pytest.mark.skipif(\n'
        '    sys.platform != "darwin" or platform.machine() != "arm64",\n'
        '    reason="Requires Apple Silicon",\n'
        ')\n'),
    "tests/test_paged_cache_benefits.py": (
        '# Skip if not on Apple Silicon\n'
        'if sys.platform != "darwin" or platform.machine() != "arm64":\n'
        '    print("This test requires Apple Silicon")\n'
        '    sys.exit(0)\n'),
}


def prepare(sdist: Path, out: Path) -> list:
    """Write the two test files, less their Apple-only skip, into ``out``.

    Raises:
        SystemExit: a file is missing from the sdist, or its skip is not
            the one expected.
    """
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1]: n for n in tar.getnames() if "/" in n}
        for f in FILES:
            if f not in names:
                raise SystemExit(f"seed_suite: {sdist} has no {f}")
            text = tar.extractfile(names[f]).read().decode()
            skip = APPLE_ONLY[f]
            if text.count(skip) != 1:
                raise SystemExit(f"seed_suite: {f} in {sdist} does not have the expected "
                                 "Apple-only skip (a different release?)")
            dest = out / Path(f).name
            dest.write_text(text.replace(skip, "# (the Apple-only skip dropped by "
                                               "tools/seed_suite.py: these run on Linux)\n"))
            written.append(dest)
    return written


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] != "prepare":
        print("usage: python -m tools.seed_suite prepare SDIST DIR", file=sys.stderr)
        return 2
    sdist = Path(argv[1])
    if not sdist.is_file():
        print(f"seed_suite: no sdist at {sdist}", file=sys.stderr)
        return 2
    for p in prepare(sdist, Path(argv[2])):
        print(f"seed_suite: wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
