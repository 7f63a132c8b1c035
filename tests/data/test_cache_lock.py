"""Separate runs sharing a token cache folder build it one at a time (qkvflow.data.cache_lock)."""

import threading
import time

from qkvflow.data import cache_lock
from qkvflow.training import session
from tests.timescale import limit


class Data:
    """What `session.build_caches` reads of a data config: its cache folder, and the build (recorded)."""

    def __init__(self, cache_dir):
        self.cache_dir = str(cache_dir)
        self.started = threading.Event()

    def build_caches(self, split):
        self.started.set()
        return {}


def test_a_run_waits_while_another_process_builds_the_same_cache(tmp_path):
    """While the build lock of a cache folder is held (by another run), `build_caches` on that folder
    does not start building; it does once the lock is released. A different folder is not held up."""
    waiting, other = Data(tmp_path / "cache"), Data(tmp_path / "other")
    with cache_lock.building(waiting.cache_dir):  # the other run, building (a separate open file: flock applies)
        thread = threading.Thread(target=session.build_caches, args=(waiting,))
        thread.start()
        session.build_caches(other)
        assert other.started.is_set()
        time.sleep(1.0)
        assert not waiting.started.is_set()  # still waiting for the lock
    thread.join(timeout=limit(30))
    assert waiting.started.is_set() and not thread.is_alive()
    assert (tmp_path / "cache" / cache_lock.LOCK_FILE).is_file()


def test_no_lock_without_a_local_cache_folder(tmp_path):
    for cache_dir in (None, "gs://bucket/cache"):
        with cache_lock.building(cache_dir):
            pass
    assert not any(tmp_path.iterdir())
