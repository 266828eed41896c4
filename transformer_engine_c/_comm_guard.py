"""What keeps CommOverlap's failures clear, apart from the class:
the per-communicator lock decorator, argument bounds and shape checks, the
marker a rank sends when it could not create its communicators, and the
release of communicators before the interpreter finalizes. Used by
userbuffers.py; tests/test_reliability*.py exercise it."""
import contextlib
import functools
import gc
import operator
import threading


def _serialised(method):
    """Run the method holding the communicator for the calling thread
    (_OneThread: a second thread arriving meanwhile is refused)."""
    @functools.wraps(method)
    def locked(self, *args, **kw):
        with self._lock:
            return method(self, *args, **kw)
    return locked


class _OneThread:
    """A communicator's hold: one thread at a time, reentrant for it. Ranks
    pair a communicator's operations in the order each rank issues them, and
    two threads in it at once are ordered differently on different ranks, so
    they would pair different calls and compute wrong results with no error.
    A thread that finds the communicator held by another is refused; from then
    on every operation on it is refused on this rank (the holder's current one
    when it ends, the peers' next ones when their waits on this rank time out),
    so a run cannot go on with a wrong pairing. close() still works."""
    __slots__ = ("_mu", "_holder", "_depth", "refused", "name")

    def __init__(self):
        self._mu = threading.Lock()
        self._holder, self._depth, self.refused, self.name = None, 0, None, "?"

    def __enter__(self):
        return self._take(closing=False)

    def _take(self, closing):
        me = threading.current_thread()
        with self._mu:
            if self._holder in (None, me) and (self.refused is None or closing):
                self._holder, self._depth = me, self._depth + 1
                return self
            if self.refused is None:
                self.refused = (
                    f"communicator '{self.name}': thread {me.name!r} called it while thread "
                    f"{self._holder.name!r} was in an operation on it. Ranks pair a communicator's operations in the "
                    "order each rank issues them, so two threads in one communicator at once pair different "
                    "calls on different ranks; it now refuses every operation on this rank (close it and make "
                    "another). Give each thread its own communicator, or let the threads take turns in the same "
                    "order on every rank")
            raise RuntimeError(self.refused)

    def _release(self):
        with self._mu:
            self._depth -= 1
            if not self._depth:
                self._holder = None
            return self.refused

    def __exit__(self, kind, value, tb):
        refused = self._release()
        if refused is not None and kind is None:
            raise RuntimeError(refused)
        return False

    @contextlib.contextmanager
    def closing(self):
        """The hold for close(): granted on a refused communicator too, once
        no other thread is in it."""
        self._take(closing=True)
        try:
            yield
        finally:
            self._release()


class _CreateFailed:
    """What a rank that could not create its communicators sends its peers
    in the handle exchange (a plain object: it is pickled)."""

    def __init__(self, kind, message):
        self.kind, self.message = kind, message


# Bounds of CommOverlap's arguments: the engine's region (data, staging,
# flags) must be addressable with room to spare; timeouts are finite
# (TEC_COMM_TIMEOUT_MAX of tec.h).
_BUFFER_BYTES_MAX = 2 ** 60
_TIMEOUT_MAX = 1e6


def _int_shape(shape, what):
    """A shape as a tuple of Python ints: each entry an integer (a float or
    a bool is refused, never truncated)."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"{what} must be a sequence of ints, got {type(shape).__name__}") from None
    out = []
    for d in dims:
        if isinstance(d, bool) or not hasattr(d, "__index__"):
            raise TypeError(f"{what} must be a sequence of ints, got {shape!r}")
        out.append(operator.index(d))
    return tuple(out)


def release_at_exit(registry):
    """atexit: release what this package holds while the interpreter is
    still whole. Communicators (ours, in the registry and in reference
    cycles through layers) keep their tp_group alive; a process group whose
    last reference goes in the interpreter's final collection joins gloo's
    worker threads after Python has started finalizing, and a worker that
    then drops a finished collective (whose thread-local state holds Python
    objects, e.g. saved-tensor hooks) must take the GIL and exits the thread
    from inside a destructor: "terminate called without an active
    exception". Closing locally (no collective: the peers may be gone) and
    collecting here lets the group go while its threads can still finish.
    `registry`: userbuffers' {name: CommOverlap} (its owner passes it)."""
    from .distributed import close_engine_collectives

    try:  # their watchdogs stop before CUDA goes; they also hold process groups
        close_engine_collectives(abort=True)
    except Exception:  # noqa: BLE001 - best effort at exit
        pass

    for c in list(registry.values()):
        try:
            c.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    registry.clear()
    gc.collect()
