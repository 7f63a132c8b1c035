"""Independent processes that share a token cache folder take turns building it.

Levanter's `build_or_load_cache` coordinates the processes of one `jax.distributed` run, not separate
runs: two `qkvflow train` processes that find the same cache missing (`qkvflow bench compare --jobs`,
or two runs started together on one corpus) both write it, and one of them then fails reading a
half-written zarr file ("Invalid JSON", seen with 9 runs on one GPU). Every verb builds through
`build(data, split)`, which holds a blocking `fcntl.flock` on `<cache_dir>/.qkvflow-build.lock` around
Levanter's build, so that the second process waits until the first has written the cache and then
loads it. The kernel releases the lock when its holder ends in any way. With several processes of one
run, a remote cache (gs://, s3://) or no top-level `cache_dir` (each component its own), no lock is
taken: Levanter's own coordination applies there.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

LOCK_FILE = ".qkvflow-build.lock"


@contextlib.contextmanager
def building(cache_dir: Optional[str]):
    """Hold the build lock of the local cache folder `cache_dir` (created if missing) for the block."""
    import fcntl

    import jax

    if not cache_dir or "://" in str(cache_dir) or jax.process_count() > 1:
        yield
        return
    os.makedirs(cache_dir, exist_ok=True)
    fd = os.open(os.path.join(cache_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks while another process builds this cache
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def build(data, split: str) -> dict:
    """Levanter's `data.build_caches(split)` (tokenizing on the first call, loading after), under the lock of
    the data config's cache folder."""
    with building(data.cache_dir):
        return data.build_caches(split)
